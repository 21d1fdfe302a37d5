/* The C ABI from C: three ranks as threads of this process, over two loopback rails, through
 * libr2ccl.so only. Every collective (out of place and in place) and the grouped send/recv below
 * and above the eager limit, each result checked element by element; registered buffers; bad
 * input answered with the right code and a message that names what was wrong, the communicator
 * usable afterwards; split (color < 0 included), finalize, destroy, and an abort from another
 * thread that ends a blocked receive.
 *
 * Exit status 0 when every check passed; each failed check prints one line naming it. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "r2ccl.h"

#define NRANKS 3
#define COUNT 1000

static int failures;
static pthread_mutex_t failures_mutex = PTHREAD_MUTEX_INITIALIZER;
static r2cclUniqueId id;
static pthread_barrier_t barrier;
#define BIG (64 * 1024) /* int32 elements of the second ring: 256 KiB, past the eager limit */

static void failed(int rank, const char* what, const char* detail) {
  pthread_mutex_lock(&failures_mutex);
  ++failures;
  fprintf(stderr, "FAIL rank %d: %s%s%s\n", rank, what, detail ? ": " : "", detail ? detail : "");
  pthread_mutex_unlock(&failures_mutex);
}

/* A call that must succeed. */
#define OK(rank, comm, call)                                              \
  do {                                                                    \
    r2cclResult_t r_ = (call);                                            \
    if (r_ != r2cclSuccess) failed(rank, #call, r2cclGetLastError(comm)); \
  } while (0)

/* A call that must fail with `code` and a last error containing `words`. */
static void refused(int rank, r2cclComm_t comm, const char* what, r2cclResult_t got,
                    r2cclResult_t want, const char* words) {
  char detail[512];
  const char* text = r2cclGetLastError(comm);
  if (got != want) {
    snprintf(detail, sizeof detail, "returned %d (%s), wanted %d; last error: %s", (int)got,
             r2cclGetErrorString(got), (int)want, text);
    failed(rank, what, detail);
  } else if (strstr(text, words) == NULL) {
    snprintf(detail, sizeof detail, "the error does not say '%s': %s", words, text);
    failed(rank, what, detail);
  }
}

static float value(int rank, int i) {
  return (float)((rank + 1) * 1000 + i % 97);
}

static void check_floats(int rank, const char* what, const float* got, const float* want, int n) {
  for (int i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      char detail[160];
      snprintf(detail, sizeof detail, "element %d is %g, wanted %g", i, (double)got[i],
               (double)want[i]);
      failed(rank, what, detail);
      return;
    }
}

static void* abort_later(void* arg) {
  const struct timespec pause = {0, 300 * 1000 * 1000};
  nanosleep(&pause, NULL);
  if (r2cclCommAbort((r2cclComm_t)arg) != r2cclSuccess)
    failed(0, "r2cclCommAbort", r2cclGetLastError(NULL));
  return NULL;
}

static void abort_a_blocked_receive(r2cclComm_t comm) {
  pthread_t aborter;
  if (pthread_create(&aborter, NULL, abort_later, comm) != 0) {
    failed(0, "pthread_create", NULL);
    return;
  }
  int32_t in[16];
  const r2cclResult_t r = r2cclRecv(in, 16, r2cclInt32, 1, comm, NULL);
  pthread_join(aborter, NULL);
  if (r == r2cclSuccess) failed(0, "a receive on an aborted communicator", "succeeded");
  int n = 0;
  refused(0, comm, "a call on an aborted communicator", r2cclCommCount(comm, &n),
          r2cclInvalidArgument, "not a live communicator");
  refused(0, comm, "destroying an aborted communicator", r2cclCommDestroy(comm),
          r2cclInvalidArgument, "r2cclCommDestroy: comm is not a live communicator");
}

static void* rank_main(void* arg) {
  const int rank = (int)(size_t)arg;
  r2cclComm_t comm = NULL;
  r2cclResult_t r = r2cclCommInitRank(&comm, NRANKS, id, rank);
  if (r != r2cclSuccess) {
    failed(rank, "r2cclCommInitRank", r2cclGetLastError(NULL));
    return NULL;
  }
  int n = 0, me = -1;
  OK(rank, comm, r2cclCommCount(comm, &n));
  OK(rank, comm, r2cclCommUserRank(comm, &me));
  if (n != NRANKS || me != rank) failed(rank, "count/rank", "wrong values");

  float* send = malloc(sizeof(float) * COUNT * NRANKS);
  float* recv = malloc(sizeof(float) * COUNT * NRANKS);
  float* want = malloc(sizeof(float) * COUNT * NRANKS);
  if (!send || !recv || !want) {
    failed(rank, "malloc", NULL);
    return NULL;
  }

  /* All-reduce, sum, out of place: the input is never written. */
  for (int i = 0; i < COUNT; ++i) {
    send[i] = value(rank, i);
    want[i] = value(0, i) + value(1, i) + value(2, i);
  }
  OK(rank, comm, r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, comm, NULL));
  check_floats(rank, "all-reduce sum", recv, want, COUNT);
  for (int i = 0; i < COUNT; ++i)
    if (send[i] != value(rank, i)) {
      failed(rank, "all-reduce", "wrote its input");
      break;
    }

  /* All-gather: rank r's block at r * COUNT. */
  for (int i = 0; i < COUNT; ++i)
    send[i] = value(rank, i);
  for (int p = 0; p < NRANKS; ++p)
    for (int i = 0; i < COUNT; ++i)
      want[p * COUNT + i] = value(p, i);
  OK(rank, comm, r2cclAllGather(send, recv, COUNT, r2cclFloat32, comm, NULL));
  check_floats(rank, "all-gather", recv, want, COUNT * NRANKS);

  /* Reduce-scatter, max: block `rank` of the element-wise maximum; each block's values carry
   * its index, so a block delivered to the wrong rank shows. */
  for (int p = 0; p < NRANKS; ++p)
    for (int i = 0; i < COUNT; ++i)
      send[p * COUNT + i] = value((rank + p) % NRANKS, i) + (float)(p * 10000);
  for (int i = 0; i < COUNT; ++i)
    want[i] = value(2, i) + (float)(rank * 10000);
  OK(rank, comm, r2cclReduceScatter(send, recv, COUNT, r2cclFloat32, r2cclMax, comm, NULL));
  check_floats(rank, "reduce-scatter max", recv, want, COUNT);

  /* In place: all-reduce with recvbuff == sendbuff, all-gather from recvbuff + rank * count,
   * reduce-scatter into sendbuff + rank * count. */
  for (int i = 0; i < COUNT; ++i) {
    recv[i] = value(rank, i);
    want[i] = value(0, i) + value(1, i) + value(2, i);
  }
  OK(rank, comm, r2cclAllReduce(recv, recv, COUNT, r2cclFloat32, r2cclSum, comm, NULL));
  check_floats(rank, "in-place all-reduce", recv, want, COUNT);
  for (int p = 0; p < NRANKS; ++p)
    for (int i = 0; i < COUNT; ++i) {
      recv[p * COUNT + i] = p == rank ? value(rank, i) : -1.0f;
      want[p * COUNT + i] = value(p, i);
    }
  OK(rank, comm, r2cclAllGather(recv + rank * COUNT, recv, COUNT, r2cclFloat32, comm, NULL));
  check_floats(rank, "in-place all-gather", recv, want, COUNT * NRANKS);
  for (int p = 0; p < NRANKS; ++p)
    for (int i = 0; i < COUNT; ++i)
      recv[p * COUNT + i] = value(rank, i) + (float)(p * 10000);
  for (int i = 0; i < COUNT; ++i)
    want[i] = value(0, i) + value(1, i) + value(2, i) + (float)(NRANKS * rank * 10000);
  OK(rank, comm,
     r2cclReduceScatter(recv, recv + rank * COUNT, COUNT, r2cclFloat32, r2cclSum, comm, NULL));
  check_floats(rank, "in-place reduce-scatter", recv + rank * COUNT, want, COUNT);

  /* A registered buffer: all-reduce from it, then deregistered; a handle never made is refused. */
  void* handle = NULL;
  OK(rank, comm, r2cclCommRegister(comm, send, sizeof(float) * COUNT, &handle));
  for (int i = 0; i < COUNT; ++i) {
    send[i] = value(rank, i);
    want[i] = value(0, i) + value(1, i) + value(2, i);
  }
  OK(rank, comm, r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, comm, NULL));
  check_floats(rank, "all-reduce from a registered buffer", recv, want, COUNT);
  OK(rank, comm, r2cclCommDeregister(comm, handle));
  refused(rank, comm, "deregistering twice", r2cclCommDeregister(comm, handle),
          r2cclInvalidArgument, "r2cclCommDeregister");

  /* Broadcast from rank 1. */
  for (int i = 0; i < COUNT; ++i) {
    send[i] = value(rank, i);
    want[i] = value(1, i);
  }
  OK(rank, comm, r2cclBroadcast(send, recv, COUNT, r2cclFloat32, 1, comm, NULL));
  check_floats(rank, "broadcast", recv, want, COUNT);

  /* Reduce (min) to rank 2. */
  for (int i = 0; i < COUNT; ++i) {
    send[i] = value(rank, i);
    want[i] = value(0, i);
  }
  OK(rank, comm, r2cclReduce(send, recv, COUNT, r2cclFloat32, r2cclMin, 2, comm, NULL));
  if (rank == 2) check_floats(rank, "reduce min", recv, want, COUNT);

  /* A ring of grouped sends and receives: to the next rank, from the previous one. */
  int32_t out[64], in[64];
  for (int i = 0; i < 64; ++i)
    out[i] = rank * 100 + i;
  OK(rank, comm, r2cclGroupStart());
  OK(rank, comm, r2cclSend(out, 64, r2cclInt32, (rank + 1) % NRANKS, comm, NULL));
  OK(rank, comm, r2cclRecv(in, 64, r2cclInt32, (rank + NRANKS - 1) % NRANKS, comm, NULL));
  OK(rank, comm, r2cclGroupEnd());
  for (int i = 0; i < 64; ++i)
    if (in[i] != ((rank + NRANKS - 1) % NRANKS) * 100 + i) {
      failed(rank, "grouped send/recv", "wrong data");
      break;
    }

  /* The same ring past the eager limit: both directions must be posted before either waits. */
  int32_t* big_out = malloc(sizeof(int32_t) * BIG);
  int32_t* big_in = malloc(sizeof(int32_t) * BIG);
  if (!big_out || !big_in) {
    failed(rank, "malloc", NULL);
    return NULL;
  }
  for (int i = 0; i < BIG; ++i)
    big_out[i] = rank * 1000000 + i;
  OK(rank, comm, r2cclGroupStart());
  OK(rank, comm, r2cclSend(big_out, BIG, r2cclInt32, (rank + 1) % NRANKS, comm, NULL));
  OK(rank, comm, r2cclRecv(big_in, BIG, r2cclInt32, (rank + NRANKS - 1) % NRANKS, comm, NULL));
  OK(rank, comm, r2cclGroupEnd());
  for (int i = 0; i < BIG; ++i)
    if (big_in[i] != ((rank + NRANKS - 1) % NRANKS) * 1000000 + i) {
      failed(rank, "grouped send/recv past the eager limit", "wrong data");
      break;
    }
  /* Their cached registrations go before the memory does. */
  OK(rank, comm, r2cclCommInvalidateCache(comm, big_out, sizeof(int32_t) * BIG));
  OK(rank, comm, r2cclCommInvalidateCache(comm, big_in, sizeof(int32_t) * BIG));
  refused(rank, NULL, "invalidating without a communicator",
          r2cclCommInvalidateCache(NULL, big_in, 4), r2cclInvalidArgument,
          "r2cclCommInvalidateCache: comm is NULL");
  free(big_out);
  free(big_in);

  /* Bad input: refused, named, and the communicator still works. */
  refused(rank, comm, "unknown datatype",
          r2cclAllReduce(send, recv, COUNT, (r2cclDataType_t)42, r2cclSum, comm, NULL),
          r2cclInvalidArgument, "datatype 42 is not a datatype");
  refused(rank, comm, "an NCCL datatype r2ccl does not reduce",
          r2cclAllReduce(send, recv, COUNT, r2cclInt8, r2cclSum, comm, NULL), r2cclInvalidArgument,
          "datatype 0 (int8) is not supported");
  refused(rank, comm, "unknown reduction",
          r2cclAllReduce(send, recv, COUNT, r2cclFloat32, (r2cclRedOp_t)-1, comm, NULL),
          r2cclInvalidArgument, "op -1 is not a reduction");
  refused(rank, comm, "a stream",
          r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, comm, (r2cclStream_t)send),
          r2cclInvalidArgument, "stream must be NULL");
  {
    /* Device memory: where this library has none (no CUDA in the build, or no device here),
     * setting up a communicator's GPU side is refused on every rank and says why. */
    int cuda = -1;
    OK(rank, NULL, r2cclGetCudaSupport(&cuda));
    if (cuda != 0 && cuda != 1) failed(rank, "r2cclGetCudaSupport", "neither 0 nor 1");
    refused(rank, NULL, "r2cclGetCudaSupport(NULL)", r2cclGetCudaSupport(NULL),
            r2cclInvalidArgument, "supported is NULL");
    if (cuda == 0) {
      const r2cclResult_t r = r2cclCommBindDevice(comm, 0);
      if (r == r2cclSuccess) failed(rank, "r2cclCommBindDevice", "succeeded without CUDA");
      if (strstr(r2cclGetLastError(comm), "CUDA") == NULL)
        failed(rank, "r2cclCommBindDevice", r2cclGetLastError(comm));
    }
  }
  refused(rank, NULL, "a NULL communicator",
          r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, NULL, NULL),
          r2cclInvalidArgument, "comm is NULL");
  refused(rank, comm, "a peer out of range", r2cclSend(out, 64, r2cclInt32, 7, comm, NULL),
          r2cclInvalidArgument, "7");
  OK(rank, comm, r2cclBarrier(comm, NULL));
  for (int i = 0; i < COUNT; ++i) {
    send[i] = (float)rank;
    want[i] = 3.0f; /* 0 + 1 + 2 */
  }
  OK(rank, comm, r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, comm, NULL));
  check_floats(rank, "all-reduce after refused calls", recv, want, COUNT);

  /* Split by parity: {0, 2} and {1}. */
  r2cclComm_t half = NULL;
  OK(rank, comm, r2cclCommSplit(comm, rank % 2, rank, &half, NULL));
  if (half == NULL) {
    failed(rank, "r2cclCommSplit", "no communicator");
  } else {
    int hn = 0;
    OK(rank, half, r2cclCommCount(half, &hn));
    if (hn != (rank % 2 == 0 ? 2 : 1)) failed(rank, "split size", "wrong");
    for (int i = 0; i < COUNT; ++i) {
      send[i] = (float)(rank + 1);
      want[i] = rank % 2 == 0 ? 4.0f : 2.0f; /* (0+1) + (2+1), or 1+1 alone */
    }
    OK(rank, half, r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, half, NULL));
    check_floats(rank, "all-reduce on the split", recv, want, COUNT);
    /* A group spans one communicator: the call on a second one is refused and not queued, and
     * the group still runs what it holds. */
    OK(rank, comm, r2cclGroupStart());
    OK(rank, comm, r2cclSend(out, 64, r2cclInt32, (rank + 1) % NRANKS, comm, NULL));
    OK(rank, comm, r2cclRecv(in, 64, r2cclInt32, (rank + NRANKS - 1) % NRANKS, comm, NULL));
    refused(rank, half, "a second communicator in one group",
            r2cclSend(out, 64, r2cclInt32, 0, half, NULL), r2cclInvalidUsage,
            "a group spans one communicator");
    OK(rank, comm, r2cclGroupEnd());
    OK(rank, half, r2cclCommDestroy(half));
  }

  /* Color < 0: rank 1 joins none; ranks 0 and 2 form a communicator of two. */
  r2cclComm_t pair = NULL;
  OK(rank, comm, r2cclCommSplit(comm, rank == 1 ? -1 : 7, 0, &pair, NULL));
  if (rank == 1) {
    if (pair != NULL) failed(rank, "r2cclCommSplit with color -1", "made a communicator");
  } else if (pair == NULL) {
    failed(rank, "r2cclCommSplit with color 7", "no communicator");
  } else {
    int pn = 0, pr = -1;
    OK(rank, pair, r2cclCommCount(pair, &pn));
    OK(rank, pair, r2cclCommUserRank(pair, &pr));
    if (pn != 2 || pr != rank / 2) failed(rank, "the pair's size and rank", "wrong");
    OK(rank, pair, r2cclCommDestroy(pair));
  }

  r2cclResult_t async = r2cclUnhandledError;
  OK(rank, comm, r2cclCommGetAsyncError(comm, &async));
  if (async != r2cclSuccess) failed(rank, "async error", r2cclGetLastError(comm));

  OK(rank, comm, r2cclBarrier(comm, NULL));
  /* Rank 0 aborts its communicator from another thread while it waits for a message rank 1
   * never sends: the receive ends with an error, and the handle is refused from then on. The
   * other ranks keep theirs until it has. */
  if (rank == 0) abort_a_blocked_receive(comm);
  pthread_barrier_wait(&barrier);
  if (rank != 0) {
    OK(rank, comm, r2cclCommFinalize(comm));
    refused(rank, comm, "a collective after finalize",
            r2cclAllReduce(send, recv, COUNT, r2cclFloat32, r2cclSum, comm, NULL),
            r2cclInvalidUsage, "finalized");
    OK(rank, comm, r2cclCommDestroy(comm));
  }
  free(send);
  free(recv);
  free(want);
  return NULL;
}

/* A destroyed handle is refused for good, even where a later communicator took its memory: one-rank
 * communicators made and destroyed in turn, every earlier handle tried on each round. */
static void stale_handles_are_refused(void) {
  enum { kRounds = 16 };
  r2cclComm_t gone[kRounds];
  for (int round = 0; round < kRounds; ++round) {
    r2cclUniqueId one;
    r2cclComm_t comm = NULL;
    if (r2cclGetUniqueId(&one) != r2cclSuccess ||
        r2cclCommInitRank(&comm, 1, one, 0) != r2cclSuccess) {
      failed(0, "a one-rank communicator", r2cclGetLastError(NULL));
      return;
    }
    for (int k = 0; k < round; ++k) {
      int rank = -1;
      if (gone[k] == comm) failed(0, "a new communicator", "it has the handle of a destroyed one");
      refused(0, NULL, "a destroyed communicator's handle", r2cclCommUserRank(gone[k], &rank),
              r2cclInvalidArgument, "not a live communicator");
    }
    OK(0, comm, r2cclCommDestroy(comm));
    gone[round] = comm;
  }
}

int main(void) {
  int version = 0;
  if (r2cclGetVersion(&version) != r2cclSuccess || version != R2CCL_VERSION_CODE) {
    fprintf(stderr, "FAIL: r2cclGetVersion gave %d, the header says %d\n", version,
            R2CCL_VERSION_CODE);
    return 1;
  }
  if (r2cclGroupEnd() != r2cclInvalidUsage ||
      strstr(r2cclGetLastError(NULL), "without r2cclGroupStart") == NULL) {
    fprintf(stderr, "FAIL: r2cclGroupEnd without a start: %s\n", r2cclGetLastError(NULL));
    return 1;
  }
  if (r2cclGetUniqueId(&id) != r2cclSuccess) {
    fprintf(stderr, "FAIL: r2cclGetUniqueId: %s\n", r2cclGetLastError(NULL));
    return 1;
  }
  pthread_barrier_init(&barrier, NULL, NRANKS);
  pthread_t threads[NRANKS];
  for (int r = 0; r < NRANKS; ++r)
    if (pthread_create(&threads[r], NULL, rank_main, (void*)(size_t)r) != 0) {
      fprintf(stderr, "FAIL: pthread_create\n");
      return 1;
    }
  for (int r = 0; r < NRANKS; ++r)
    pthread_join(threads[r], NULL);
  stale_handles_are_refused();
  if (failures == 0) printf("capi comm: every check passed (%d ranks)\n", NRANKS);
  return failures == 0 ? 0 : 1;
}
