/* An all-reduce from C over libr2ccl.so. Every rank is a process started with R2CCL_RANK,
 * R2CCL_NRANKS and R2CCL_BOOTSTRAP (rank 0's host:port), like any launcher would; the rails come
 * from R2CCL_NICS.
 *
 *   cc -o allreduce examples/allreduce.c $(pkg-config --cflags --libs r2ccl)
 *   for r in 0 1; do R2CCL_RANK=$r R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=127.0.0.1:29500 \
 *     R2CCL_NICS=127.0.0.11,127.0.0.12 ./allreduce & done; wait
 */
#include <r2ccl.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                  \
  do {                                                                               \
    r2cclResult_t r_ = (call);                                                       \
    if (r_ != r2cclSuccess) {                                                        \
      fprintf(stderr, "%s: %s\n", r2cclGetErrorString(r_), r2cclGetLastError(comm)); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

int main(void) {
  r2cclComm_t comm = NULL;
  CHECK(r2cclCommInitFromEnv(&comm));
  int rank = 0, nranks = 0;
  CHECK(r2cclCommUserRank(comm, &rank));
  CHECK(r2cclCommCount(comm, &nranks));

  enum { N = 1 << 20 };
  float* send = malloc(sizeof(float) * N);
  float* recv = malloc(sizeof(float) * N);
  if (send == NULL || recv == NULL) return 1;
  for (int i = 0; i < N; ++i)
    send[i] = (float)(rank + 1);
  CHECK(r2cclAllReduce(send, recv, N, r2cclFloat32, r2cclSum, comm, NULL));

  const float want = (float)nranks * (float)(nranks + 1) / 2.0f;
  for (int i = 0; i < N; ++i)
    if (recv[i] != want) {
      fprintf(stderr, "rank %d: element %d is %g, wanted %g\n", rank, i, (double)recv[i],
              (double)want);
      return 1;
    }
  printf("rank %d of %d: all-reduce of %d floats correct (%g)\n", rank, nranks, N, (double)want);
  free(send);
  free(recv);
  CHECK(r2cclCommDestroy(comm));
  return 0;
}
