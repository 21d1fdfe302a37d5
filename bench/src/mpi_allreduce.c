/* mpi_allreduce.c: baseline all-reduce benchmark over plain MPI_Allreduce.
 *
 * The Open MPI side of the side-by-side comparison with r2ccl (bench/baseline.sh runs it on the
 * netns testbed or on loopback; bench/gloo_allreduce.py is the Gloo side and prints the same
 * lines).  Float32 sum, out of place, conventions of nccl-tests:
 *
 *   mpi_allreduce [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W SETTLE] [-c 0|1]
 *                 [-l 0|1]
 *
 * Sizes are bytes with an optional K, M or G suffix (powers of 1024) and are rounded down to
 * whole float32 elements (at least one).  For each size, MIN, MIN*FACTOR, ... up to MAX: WARMUP
 * untimed all-reduces, a barrier, ITERS timed ones; the time of a size is the largest over the
 * ranks of the per-iteration average.  With -c 1 one more all-reduce, into a buffer poisoned
 * beforehand, is checked element by element on every rank (inputs are small integers, so the
 * float sums are exact and any difference is an error).
 *
 * Rank 0 prints one JSON object per size and line:
 *   {"impl":"openmpi","op":"allreduce","nranks":P,"bytes":B,"time_us":T,
 *    "algbw_gbps":A,"busbw_gbps":BB,"wrong":W}
 * algbw = bytes / time / 1e9, busbw = algbw * 2 * (P - 1) / P, wrong = wrong elements summed
 * over the ranks (0 when not checked).  With -l 1 every timed all-reduce is also timed on its
 * own, and the line ends with rank 0's "latency_us":{"p1":..,"p50":..,"p90":..,"p99":..,"max":..}
 * (what r2ccl-perf --latency prints for r2ccl).
 *
 * Exit status: 0 ok, 1 some element was wrong, 2 bad arguments or out of memory.
 *
 * Build: mpicc -O2 -Wall -Werror -o mpi_allreduce bench/src/mpi_allreduce.c
 */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#define MAX_BYTES ((int64_t)1 << 32) /* 4 GiB: far above what the testbed can move */
#define POISON (-1.0e30f)            /* never a valid sum of the small integer inputs */

struct options {
  int64_t min_bytes;
  int64_t max_bytes;
  int64_t factor;
  int iters;
  int warmup;
  int settle;
  int check;
  int latency; /* -l 1: time every timed all-reduce on its own */
};

/* Input of element i on rank r: an integer in [-4, 4], so every sum is exact in float32. */
static float input_value(int rank, size_t i) {
  return (float)((int)(((size_t)rank * 7u + i * 3u) % 9u) - 4);
}

/* parse_size: "64", "8K", "4M", "1G" -> bytes in *out; 0 on success, -1 on a bad value. */
static int parse_size(const char *s, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || end == s || v < 0) return -1;
  int64_t mult = 1;
  switch (*end) {
    case '\0': break;
    case 'k': case 'K': mult = (int64_t)1 << 10; end++; break;
    case 'm': case 'M': mult = (int64_t)1 << 20; end++; break;
    case 'g': case 'G': mult = (int64_t)1 << 30; end++; break;
    default: return -1;
  }
  if (*end != '\0' || v > MAX_BYTES / mult) return -1;
  *out = (int64_t)v * mult;
  return 0;
}

/* parse_int: a decimal integer in [lo, hi]; 0 on success, -1 otherwise. */
static int parse_int(const char *s, long lo, long hi, long *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: mpi_allreduce [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-W SETTLE]\n"
          "                     [-c 0|1] [-l 0|1]\n"
          "  -b MIN     smallest size in bytes, K/M/G suffixes (default 8)\n"
          "  -e MAX     largest size in bytes (default 4M)\n"
          "  -f FACTOR  size multiplier between steps, >= 2 (default 2)\n"
          "  -n ITERS   timed iterations per size (default 20)\n"
          "  -w WARMUP  untimed iterations per size (default 5)\n"
          "  -W SETTLE  untimed all-reduces of the smallest size before the first (default 0)\n"
          "  -c 0|1     check every element on every rank (default 1)\n"
          "  -l 0|1     time every timed all-reduce on its own: rank 0's p1, p50, p90, p99 and\n"
          "             maximum (us) in the JSON line (default 0)\n");
}

/* parse_options: 0 ok, 1 help printed, 2 bad arguments (message printed by rank 0 only). */
static int parse_options(int argc, char **argv, int rank, struct options *o) {
  o->min_bytes = 8;
  o->max_bytes = (int64_t)4 << 20;
  o->factor = 2;
  o->iters = 20;
  o->warmup = 5;
  o->settle = 0;
  o->check = 1;
  o->latency = 0;
  int c;
  long v;
  opterr = 0;
  while ((c = getopt(argc, argv, "b:e:f:n:w:W:c:l:h")) != -1) {
    const char *bad = NULL;
    switch (c) {
      case 'b': if (parse_size(optarg, &o->min_bytes) != 0) bad = "-b: a size such as 8, 64K, 4M"; break;
      case 'e': if (parse_size(optarg, &o->max_bytes) != 0) bad = "-e: a size such as 8, 64K, 4M"; break;
      case 'f': if (parse_int(optarg, 2, 1024, &v) != 0) bad = "-f: an integer 2..1024"; else o->factor = v; break;
      case 'n': if (parse_int(optarg, 1, 1000000, &v) != 0) bad = "-n: an integer 1..1000000"; else o->iters = (int)v; break;
      case 'w': if (parse_int(optarg, 0, 1000000, &v) != 0) bad = "-w: an integer 0..1000000"; else o->warmup = (int)v; break;
      case 'W': if (parse_int(optarg, 0, 1000000, &v) != 0) bad = "-W: an integer 0..1000000"; else o->settle = (int)v; break;
      case 'c': if (parse_int(optarg, 0, 1, &v) != 0) bad = "-c: 0 or 1"; else o->check = (int)v; break;
      case 'l': if (parse_int(optarg, 0, 1, &v) != 0) bad = "-l: 0 or 1"; else o->latency = (int)v; break;
      case 'h': if (rank == 0) usage(stdout); return 1;
      default: bad = "unknown option or missing value"; break;
    }
    if (bad != NULL) {
      if (rank == 0) {
        fprintf(stderr, "mpi_allreduce: invalid argument (%s)\n", bad);
        usage(stderr);
      }
      return 2;
    }
  }
  if (optind != argc || o->min_bytes > o->max_bytes) {
    if (rank == 0) {
      fprintf(stderr, "mpi_allreduce: %s\n",
              optind != argc ? "unexpected positional argument" : "-b must not exceed -e");
      usage(stderr);
    }
    return 2;
  }
  return 0;
}

static int compare_doubles(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The q-quantile of v[0..n) (sorted, n >= 1), nearest rank. */
static double percentile(const double *v, int n, double q) {
  int i = (int)(q * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

/* Bytes actually moved for a requested size: whole float32 elements, at least one. */
static size_t elements_for(int64_t bytes) {
  size_t n = (size_t)bytes / sizeof(float);
  return n == 0 ? 1 : n;
}

/* check_result: the number of elements of recv (count floats) that differ from the expected
 * sum; expected[k] is the sum over ranks of input_value(r, i) for every i with i % 9 == k. */
static int64_t check_result(const float *recv, size_t count, const float expected[9]) {
  int64_t wrong = 0;
  for (size_t i = 0; i < count; i++) {
    if (recv[i] != expected[i % 9]) wrong++;
  }
  return wrong;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, nranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);

  /* Every rank parses the same argv, so every rank takes the same exit. */
  struct options o;
  int prc = parse_options(argc, argv, rank, &o);
  if (prc != 0) {
    MPI_Finalize();
    return prc == 1 ? 0 : 2;
  }

  size_t max_count = elements_for(o.max_bytes);
  float *send = malloc(max_count * sizeof(float));
  float *recv = malloc(max_count * sizeof(float));
  double *op_us = malloc((size_t)o.iters * sizeof(double)); /* -l 1: each timed all-reduce */
  int oom = (send == NULL || recv == NULL || op_us == NULL), any_oom = 0;
  MPI_Allreduce(&oom, &any_oom, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_oom) {
    if (oom) fprintf(stderr, "mpi_allreduce: rank %d: cannot allocate 2 x %zu bytes\n", rank,
                     max_count * sizeof(float));
    free(send);
    free(recv);
    free(op_us);
    MPI_Finalize();
    return 2;
  }
  for (size_t i = 0; i < max_count; i++) {
    send[i] = input_value(rank, i);
    recv[i] = 0.0f; /* touch every page before timing */
  }
  /* input_value depends on i only through i % 9, so nine sums cover every element. */
  float expected[9];
  for (size_t k = 0; k < 9; k++) {
    int sum = 0;
    for (int r = 0; r < nranks; r++) sum += (int)input_value(r, k);
    expected[k] = (float)sum;
  }

  for (int it = 0; it < o.settle; it++) { /* lets the processes settle onto cores */
    MPI_Allreduce(send, recv, (int)elements_for(o.min_bytes), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  int64_t total_wrong = 0;
  /* The size grows by a factor >= 2 up to at most 4 GiB, so the loop is bounded (<= 33 steps). */
  for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
    size_t count = elements_for(bytes);
    int icount = (int)count; /* count <= 2^30 by MAX_BYTES, fits in an int */

    for (int it = 0; it < o.warmup; it++) {
      MPI_Allreduce(send, recv, icount, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int it = 0; it < o.iters; it++) {
      double a = o.latency ? MPI_Wtime() : 0.0;
      MPI_Allreduce(send, recv, icount, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      if (o.latency) op_us[it] = (MPI_Wtime() - a) * 1e6;
    }
    double avg = (MPI_Wtime() - t0) / o.iters, max_avg = 0.0;
    MPI_Reduce(&avg, &max_avg, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

    long long wrong = 0, sum_wrong = 0;
    if (o.check) {
      for (size_t i = 0; i < count; i++) recv[i] = POISON;
      MPI_Allreduce(send, recv, icount, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      wrong = (long long)check_result(recv, count, expected);
    }
    /* All ranks learn the total so that they all exit with the same status. */
    MPI_Allreduce(&wrong, &sum_wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    total_wrong += sum_wrong;

    if (rank == 0) {
      double moved = (double)(count * sizeof(float));
      double algbw = max_avg > 0.0 ? moved / max_avg / 1e9 : 0.0;
      double busbw = algbw * 2.0 * (nranks - 1) / nranks;
      printf("{\"impl\":\"openmpi\",\"op\":\"allreduce\",\"nranks\":%d,\"bytes\":%zu,"
             "\"time_us\":%.2f,\"algbw_gbps\":%.6f,\"busbw_gbps\":%.6f,\"wrong\":%lld",
             nranks, count * sizeof(float), max_avg * 1e6, algbw, busbw, sum_wrong);
      if (o.latency) {
        qsort(op_us, (size_t)o.iters, sizeof(double), compare_doubles);
        printf(",\"latency_us\":{\"p1\":%.2f,\"p50\":%.2f,\"p90\":%.2f,\"p99\":%.2f,"
               "\"max\":%.2f}",
               percentile(op_us, o.iters, 0.01), percentile(op_us, o.iters, 0.50),
               percentile(op_us, o.iters, 0.90), percentile(op_us, o.iters, 0.99),
               op_us[o.iters - 1]);
      }
      printf("}\n");
      fflush(stdout);
    }
    if (bytes > o.max_bytes / o.factor) break; /* the next step would pass MAX (or overflow) */
  }

  free(send);
  free(recv);
  free(op_us);
  MPI_Finalize();
  return total_wrong == 0 ? 0 : 1;
}
