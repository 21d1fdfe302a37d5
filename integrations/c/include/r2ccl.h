/* r2ccl: the C ABI of the multi-rail communication runtime.
 *
 * Shaped like NCCL's API, so that its users know it at once: a unique id made by rank 0 and
 * handed to every rank, communicators, collectives and point-to-point calls grouped between
 * r2cclGroupStart/End, each taking a stream argument.
 *
 * Buffers are host memory or CUDA device memory (the kind comes from cudaPointerGetAttributes).
 * Host memory: pass NULL as the stream; the call returns when it is done. Device memory (a
 * library built with CUDA; r2cclGetCudaSupport): the call is queued on `stream` (a cudaStream_t;
 * NULL is the default stream) and returns at once, as NCCL's do; it can be captured into a CUDA
 * graph. Device memory moves among the GPUs of one node, one rank per GPU, over NVLink (CUDA IPC
 * buffers set up once per communicator, by its first call on device memory or by
 * r2cclCommBindDevice) and NCCL where it is faster; point to point on device memory needs NCCL
 * (libnccl.so.2, or R2CCL_NCCL_LIBRARY). The KV-cache engine (r2cclKv*) moves blocks of a paged KV
 * cache between a prefill and a decode process.
 *
 * Every call returns an r2cclResult_t; nothing else crosses this boundary (no C++ exception, no
 * abort on bad input). After a failure, r2cclGetLastError(comm) says what was wrong in words;
 * r2cclGetLastError(NULL) says it for the calling thread's last failed call.
 *
 * Thread safety: like an NCCL communicator, one communicator is used from one thread at a
 * time, except r2cclCommAbort and r2cclCommGetAsyncError, which any thread may call at any
 * time. A KV engine may be used from any thread; r2cclKvGetLastError(engine) says what its
 * last failed call did wrong.
 */
#ifndef R2CCL_H_
#define R2CCL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define R2CCL_MAJOR 0
#define R2CCL_MINOR 2
#define R2CCL_PATCH 0
#define R2CCL_VERSION(X, Y, Z) ((X)*10000 + (Y)*100 + (Z))
#define R2CCL_VERSION_CODE R2CCL_VERSION(R2CCL_MAJOR, R2CCL_MINOR, R2CCL_PATCH)

typedef enum {
  r2cclSuccess = 0,
  r2cclUnhandledError = 1,  /* an error of the runtime itself */
  r2cclSystemError = 2,     /* a socket, device or system call failed */
  r2cclInternalError = 3,   /* a bug in r2ccl */
  r2cclInvalidArgument = 4, /* a bad pointer, count, type, rank... */
  r2cclInvalidUsage = 5,    /* a call out of place (a closed communicator, an op mismatch) */
  r2cclRemoteError = 6,     /* a peer failed, left or sent something wrong */
  r2cclInProgress = 7,      /* not done yet (KV requests) */
  r2cclTimeout = 8,         /* a deadline passed */
  r2cclTryAgain = 9,        /* a queue is full: nothing was taken, call again later */
  r2cclNumResults = 10
} r2cclResult_t;

/* Datatypes and reductions carry NCCL's numbers (ncclDataType_t, ncclRedOp_t), so that code
 * written against NCCL's values keeps them. r2cclInt8, r2cclUint32, r2cclUint64 and the FP8
 * types are named for that numbering but not supported: a call with one returns
 * r2cclInvalidArgument. */
typedef enum {
  r2cclInt8 = 0,
  r2cclChar = 0,
  r2cclUint8 = 1,
  r2cclInt32 = 2,
  r2cclInt = 2,
  r2cclUint32 = 3,
  r2cclInt64 = 4,
  r2cclUint64 = 5,
  r2cclFloat16 = 6,
  r2cclHalf = 6,
  r2cclFloat32 = 7,
  r2cclFloat = 7,
  r2cclFloat64 = 8,
  r2cclDouble = 8,
  r2cclBfloat16 = 9,
  r2cclFloat8e4m3 = 10,
  r2cclFloat8e5m2 = 11,
  r2cclNumTypes = 12
} r2cclDataType_t;

typedef enum {
  r2cclSum = 0,
  r2cclProd = 1,
  r2cclMax = 2,
  r2cclMin = 3,
  r2cclAvg = 4,
  r2cclNumOps = 5
} r2cclRedOp_t;

#define R2CCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[R2CCL_UNIQUE_ID_BYTES];
} r2cclUniqueId;

typedef struct r2cclComm* r2cclComm_t;
/* A stream: NULL for host memory; a cudaStream_t for device memory (NULL: the default stream). */
typedef void* r2cclStream_t;

/* ---- version and errors */
r2cclResult_t r2cclGetVersion(int* version);
const char* r2cclGetErrorString(r2cclResult_t result);
/* The text of the last error on `comm` (NULL, or a communicator already freed: of the calling
 * thread's last failed call); "" when none. Valid until the calling thread's next r2ccl call. */
const char* r2cclGetLastError(r2cclComm_t comm);

/* 1 where this library moves device memory (built with CUDA, and a CUDA device can be used),
 * else 0. */
r2cclResult_t r2cclGetCudaSupport(int* supported);

/* ---- communicators */
/* Rank 0 only: starts the rendezvous listener in this process (on R2CCL_SOCKET_IFNAME's
 * address, else the first interface that is up, has an IPv4 address and is neither loopback, a
 * rail (R2CCL_NICS) nor a container or VM bridge (docker*, br-*, virbr*, veth*), else loopback)
 * and makes the id, with a fresh
 * random job token. Hand the 128 bytes to every rank by any means; rank 0 itself must call
 * r2cclCommInitRank in the process that made the id. */
r2cclResult_t r2cclGetUniqueId(r2cclUniqueId* uniqueId);
/* Every rank, with the same id and nranks; blocks until all have joined
 * (R2CCL_BOOTSTRAP_TIMEOUT). */
r2cclResult_t r2cclCommInitRank(r2cclComm_t* comm, int nranks, r2cclUniqueId commId, int rank);
/* From the launch environment (R2CCL_RANK / R2CCL_NRANKS / R2CCL_BOOTSTRAP /
 * R2CCL_BOOTSTRAP_TOKEN, or mpirun's variables). */
r2cclResult_t r2cclCommInitFromEnv(r2cclComm_t* comm);
/* Ranks with the same color form a new communicator, ordered by (key, rank); color < 0 joins
 * none (*newcomm = NULL). Every rank of `comm` calls it. `config` must be NULL. */
r2cclResult_t r2cclCommSplit(r2cclComm_t comm, int color, int key, r2cclComm_t* newcomm,
                             void* config);
/* Completes what was posted; the communicator then takes no more operations. Where it has a
 * device side, waits for its calls and frees its GPU memory once every rank has unmapped it: a
 * collective (every rank calls it). */
r2cclResult_t r2cclCommFinalize(r2cclComm_t comm);
/* Frees it (NULL is accepted); a collective where the communicator has a device side and was not
 * finalized, as Finalize. */
r2cclResult_t r2cclCommDestroy(r2cclComm_t comm);
/* Fails what is in flight and everything after, from any thread, then frees it like
 * r2cclCommDestroy (calls still inside it return an error first; the memory goes with the last
 * of them). Device collectives spinning on a GPU give up at once, and every other rank's device
 * calls fail from then on (r2cclCommGetAsyncError says which rank aborted); the GPU memory that
 * the other ranks map stays allocated until the process ends. A handle already freed is refused
 * with r2cclInvalidArgument, not used. */
r2cclResult_t r2cclCommAbort(r2cclComm_t comm);
/* The first asynchronous error (a peer left, no rail survived, an abort, here or on another
 * rank's device side): r2cclSuccess while none. Device collectives wait for late ranks as long as
 * it takes, as NCCL's do; once this reports an error, a device call that was in flight may have
 * left wrong data in its output, and every later call is refused. Any thread, any time; it does
 * not wait for the device. */
r2cclResult_t r2cclCommGetAsyncError(r2cclComm_t comm, r2cclResult_t* asyncError);
r2cclResult_t r2cclCommCount(const r2cclComm_t comm, int* count);
r2cclResult_t r2cclCommUserRank(const r2cclComm_t comm, int* rank);
/* Sets up the communicator's device side on CUDA device `device` (-1: the calling thread's
 * current device) now: the NVLink buffers, their IPC handles, NCCL. Every rank calls it, each
 * with its own GPU. The first call on device memory does the same where this was not called,
 * but not while its stream is being captured into a CUDA graph: call this (or run one call on
 * device memory) before capturing. */
r2cclResult_t r2cclCommBindDevice(r2cclComm_t comm, int device);
/* A buffer used again and again (ncclCommRegister): registered once on every rail. */
r2cclResult_t r2cclCommRegister(const r2cclComm_t comm, void* buff, size_t size, void** handle);
r2cclResult_t r2cclCommDeregister(const r2cclComm_t comm, void* handle);
/* Host buffers above 64 KiB that are not registered keep their registrations for later calls
 * (R2CCL_REG_CACHE; by default only with providers whose registrations pin nothing, such as tcp).
 * This drops those of [buff, buff + size): with R2CCL_REG_CACHE=on under verbs, call it before
 * freeing or unmapping memory passed to a call. Harmless otherwise; any thread, also after an
 * abort. */
r2cclResult_t r2cclCommInvalidateCache(const r2cclComm_t comm, const void* buff, size_t size);

/* ---- collectives: `count` in elements; in place when sendbuff == recvbuff (all-gather:
 * sendbuff == recvbuff + rank * count; reduce-scatter: recvbuff == sendbuff + rank * count). */
r2cclResult_t r2cclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                             r2cclStream_t stream);
r2cclResult_t r2cclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, int root, r2cclComm_t comm,
                             r2cclStream_t stream);
r2cclResult_t r2cclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          r2cclDataType_t datatype, r2cclRedOp_t op, int root, r2cclComm_t comm,
                          r2cclStream_t stream);
/* sendcount elements from each rank; recvbuff holds nranks * sendcount. */
r2cclResult_t r2cclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             r2cclDataType_t datatype, r2cclComm_t comm, r2cclStream_t stream);
/* recvcount elements to each rank; sendbuff holds nranks * recvcount. */
r2cclResult_t r2cclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                                 r2cclStream_t stream);
/* Returns once every rank reached it; with a stream, once the work queued on it is done too. */
r2cclResult_t r2cclBarrier(r2cclComm_t comm, r2cclStream_t stream);

/* ---- point to point, matched in order per pair; group them to post both directions at once */
r2cclResult_t r2cclSend(const void* sendbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream);
r2cclResult_t r2cclRecv(void* recvbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream);
/* Calls between these are queued and run together at r2cclGroupEnd (per thread, nestable). A
 * group spans one communicator: a call on a second one inside it returns r2cclInvalidUsage. */
r2cclResult_t r2cclGroupStart(void);
r2cclResult_t r2cclGroupEnd(void);

/* ---- KV-cache engine: blocks of a paged KV cache pushed (or pulled) between processes that are
 * not in one communicator (a prefill and a decode server). Each side makes an engine on its own
 * endpoint (its rails: R2CCL_NICS), registers its cache as a pool, and hands its metadata (bytes)
 * to the other side by any means; the side that loads it can push to, or pull from, the other.
 * Pools are host memory or CUDA device/managed memory; device memory moves over tcp rails
 * through host copies (the verbs provider refuses it: no GPUDirect RDMA yet).
 */
typedef struct r2cclKvEngine* r2cclKvEngine_t;

/* The structs below begin, as NCCL's ncclConfig_t does, with their size, R2CCL_STRUCT_MAGIC and
 * the version of this header they were written for: a later version adds fields at their end and
 * still reads what an earlier caller passes, and one that was not started from its initializer
 * is refused with a message saying so instead of being read as garbage. Start each from its
 * R2CCL_KV_..._INITIALIZER (r2cclKvNotification too: the caller's size says what may be
 * written). A version newer than the library's is refused. */
#define R2CCL_STRUCT_MAGIC 0x72326363u /* "r2cc" */
#define R2CCL_STRUCT_VERSION 1u

/* Where layer L's part P (K or V; one part when joined, or MLA) keeps block 0, and the distance
 * between consecutive blocks, in buffer `buffer` of the pool. */
typedef struct {
  uint32_t buffer;
  uint64_t offset;
  uint64_t stride;
} r2cclKvPlace;

typedef struct {
  size_t size;          /* sizeof(r2cclKvLayout) */
  unsigned int magic;   /* R2CCL_STRUCT_MAGIC */
  unsigned int version; /* R2CCL_STRUCT_VERSION */
  uint32_t layers;
  uint32_t blocks;     /* blocks per layer */
  uint64_t blockBytes; /* one part of one block of one layer */
  uint32_t parts;      /* 2: K and V apart; 1: joined, or MLA */
  /* layers * parts entries, index layer * parts + part; NULL: every layer and part one after
   * another in buffer 0 (layer-major: block b of layer L, part P at
   * ((L * parts + P) * blocks + b) * blockBytes). */
  const r2cclKvPlace* places;
} r2cclKvLayout;
#define R2CCL_KV_LAYOUT_INITIALIZER \
  { sizeof(r2cclKvLayout), R2CCL_STRUCT_MAGIC, R2CCL_STRUCT_VERSION, 0, 0, 0, 0, NULL }

/* Blocks of layers [firstLayer, lastLayer), every part: srcBlocks[i] of the sending pool lands
 * in dstBlocks[i] of the receiving one. Each span of an array starts from the initializer. */
typedef struct {
  size_t size;          /* sizeof(r2cclKvSpan) */
  unsigned int magic;   /* R2CCL_STRUCT_MAGIC */
  unsigned int version; /* R2CCL_STRUCT_VERSION */
  uint32_t firstLayer;
  uint32_t lastLayer;
  const uint32_t* srcBlocks;
  const uint32_t* dstBlocks;
  size_t nblocks;
} r2cclKvSpan;
#define R2CCL_KV_SPAN_INITIALIZER \
  { sizeof(r2cclKvSpan), R2CCL_STRUCT_MAGIC, R2CCL_STRUCT_VERSION, 0, 0, NULL, NULL, 0 }

typedef enum {
  r2cclKvPending = 0,
  r2cclKvInFlight = 1,
  r2cclKvDone = 2,
  r2cclKvFailed = 3,
  r2cclKvCancelled = 4
} r2cclKvState_t;

/* A request pushed to this side has ended (r2cclKvGetNotification). */
typedef struct {
  size_t size;          /* sizeof(r2cclKvNotification) */
  unsigned int magic;   /* R2CCL_STRUCT_MAGIC */
  unsigned int version; /* R2CCL_STRUCT_VERSION */
  uint64_t request;
  int peer;             /* the side that pushed, as this engine numbers it */
  r2cclKvState_t state; /* DONE, FAILED or CANCELLED */
  int verified;         /* R2CCL_KV_VERIFY: every block's checksum matched */
  size_t payloadBytes;  /* the sender's payload (e.g. the first token): its full length */
  size_t invalidBlocks; /* FAILED/CANCELLED: destination blocks not valid (their count; the list:
                         * r2cclKvGetInvalidBlocks) */
  char reason[256];     /* FAILED/CANCELLED: why, in words (NUL-terminated, cut to fit) */
} r2cclKvNotification;
#define R2CCL_KV_NOTIFICATION_INITIALIZER                                                        \
  {                                                                                              \
    sizeof(r2cclKvNotification), R2CCL_STRUCT_MAGIC, R2CCL_STRUCT_VERSION, 0, 0, r2cclKvPending, \
        0, 0, 0, {                                                                               \
      0                                                                                          \
    }                                                                                            \
  }

/* An engine on an endpoint of its own (R2CCL_NICS, R2CCL_KV_VERIFY, ...); `name` labels this
 * side in the peer's messages (NULL: host:pid). */
r2cclResult_t r2cclKvEngineCreate(r2cclKvEngine_t* engine, const char* name);
/* Frees it (NULL is accepted); calls still inside it on other threads finish first. A handle
 * already freed is refused with r2cclInvalidArgument by every call, not used. */
r2cclResult_t r2cclKvEngineDestroy(r2cclKvEngine_t engine);
const char* r2cclKvGetLastError(r2cclKvEngine_t engine);
/* Registers `nbuffers` buffers laid out as `layout` (remote-writable: peers that hold the
 * metadata may write blocks into them). They stay owned by the caller and allocated until
 * r2cclKvUnregisterPool (or the engine's destruction) returns. Host memory (pageable or
 * pinned), or CUDA device or managed memory (recognised through the CUDA driver): its blocks
 * must be complete on the GPU when a request that reads them is submitted (the stream that
 * wrote them synchronized), and a notification comes after every byte was copied into the
 * receiver's GPU memory. */
r2cclResult_t r2cclKvRegisterPool(r2cclKvEngine_t engine, void* const* buffers,
                                  const size_t* lengths, int nbuffers, const r2cclKvLayout* layout,
                                  uint32_t* pool);
r2cclResult_t r2cclKvUnregisterPool(r2cclKvEngine_t engine, uint32_t pool);
/* This side's metadata (endpoint, token, pools). With buf NULL, or *len too small, *len is set
 * to the size needed (and r2cclInvalidArgument returned when buf was given). */
r2cclResult_t r2cclKvGetMetadata(r2cclKvEngine_t engine, void* buf, size_t* len);
/* Connects to the side whose metadata this is; *peer is its number here. */
r2cclResult_t r2cclKvLoadRemote(r2cclKvEngine_t engine, const void* metadata, size_t len,
                                int* peer);
r2cclResult_t r2cclKvDisconnect(r2cclKvEngine_t engine, int peer);
/* The most bytes a request's payload may carry (r2cclKvSubmit, r2cclKvSeal). */
#define R2CCL_KV_MAX_PAYLOAD 4096

/* Push request `id` (unique on this engine) of blocks of `localPool` into the peer's
 * `remotePool`; the peer gets a notification carrying `payload` once every block landed. */
r2cclResult_t r2cclKvSubmit(r2cclKvEngine_t engine, uint64_t id, int peer, uint32_t localPool,
                            uint32_t remotePool, const r2cclKvSpan* spans, size_t nspans,
                            const void* payload, size_t payloadBytes);
/* The same, layer by layer as the model computes them: begin, add spans, seal. */
r2cclResult_t r2cclKvBegin(r2cclKvEngine_t engine, uint64_t id, int peer, uint32_t localPool,
                           uint32_t remotePool);
r2cclResult_t r2cclKvAdd(r2cclKvEngine_t engine, uint64_t id, const r2cclKvSpan* span);
r2cclResult_t r2cclKvSeal(r2cclKvEngine_t engine, uint64_t id, const void* payload,
                          size_t payloadBytes);
/* Pull: the peer pushes its blocks (srcBlocks of its `remotePool`) into ours (dstBlocks). */
r2cclResult_t r2cclKvPull(r2cclKvEngine_t engine, uint64_t id, int peer, uint32_t localPool,
                          uint32_t remotePool, const r2cclKvSpan* spans, size_t nspans);
/* The request's state now; r2cclInProgress while it is pending or in flight. */
r2cclResult_t r2cclKvPoll(r2cclKvEngine_t engine, uint64_t id, r2cclKvState_t* state);
/* Waits until the request ends, at most timeoutMs (r2cclTimeout then). */
r2cclResult_t r2cclKvWait(r2cclKvEngine_t engine, uint64_t id, int timeoutMs,
                          r2cclKvState_t* state);
r2cclResult_t r2cclKvCancel(r2cclKvEngine_t engine, uint64_t id);
/* The oldest notification not yet taken: r2cclSuccess with *got = 1 and its payload copied into
 * payload, or *got = 0 when none is waiting. When its payload does not fit payloadCapacity, the
 * notification stays queued, *got = 0, note->payloadBytes says how many bytes it needs (at most
 * R2CCL_KV_MAX_PAYLOAD) and r2cclInvalidArgument is returned. */
r2cclResult_t r2cclKvGetNotification(r2cclKvEngine_t engine, r2cclKvNotification* note,
                                     void* payload, size_t payloadCapacity, int* got);
/* The destination blocks that are not valid once a request ended FAILED or CANCELLED (none after
 * DONE). peer < 0: this engine's own request `request` (a push it sent, or a pull it asked for);
 * peer >= 0: the notification of `request` from `peer` that r2cclKvGetNotification returned
 * (the last 1024 taken are kept; r2cclKvNotification.invalidBlocks is their count). *count is
 * set to how many there are; with blocks NULL nothing else is done. When capacity is smaller,
 * nothing is copied and r2cclInvalidArgument is returned. */
r2cclResult_t r2cclKvGetInvalidBlocks(r2cclKvEngine_t engine, int peer, uint64_t request,
                                      uint32_t* blocks, size_t capacity, size_t* count);

#ifdef __cplusplus
}
#endif

#endif /* R2CCL_H_ */
