/* The KV engine's C ABI from C: a prefill and a decode engine in this process, each on an
 * endpoint of its own (two loopback rails each), connected by metadata only. A whole push and a
 * layer-by-layer push, every byte of every block checked (and every block not sent still zero);
 * the decode side's notification with its payload; bad input refused with a message naming it.
 *
 * Exit status 0 when every check passed; each failed check prints one line naming it. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "r2ccl.h"

#define LAYERS 4
#define PARTS 2
#define BLOCKS 16
#define BLOCK_BYTES 256
#define POOL_BYTES (LAYERS * PARTS * BLOCKS * BLOCK_BYTES)

static int failures;

static void failed(const char* what, const char* detail) {
  ++failures;
  fprintf(stderr, "FAIL: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
}

#define OK(engine, call)                                                    \
  do {                                                                      \
    if ((call) != r2cclSuccess) failed(#call, r2cclKvGetLastError(engine)); \
  } while (0)

static void refused(r2cclKvEngine_t e, const char* what, r2cclResult_t got, r2cclResult_t want,
                    const char* words) {
  char detail[512];
  const char* text = r2cclKvGetLastError(e);
  if (got != want) {
    snprintf(detail, sizeof detail, "returned %d, wanted %d; last error: %s", (int)got, (int)want,
             text);
    failed(what, detail);
  } else if (strstr(text, words) == NULL) {
    snprintf(detail, sizeof detail, "the error does not say '%s': %s", words, text);
    failed(what, detail);
  }
}

/* Offset of (layer, part, block) in the layer-major pool. */
static size_t at(int layer, int part, int block) {
  return ((size_t)(layer * PARTS + part) * BLOCKS + (size_t)block) * BLOCK_BYTES;
}

static unsigned char pattern(int layer, int part, int block, int i) {
  return (unsigned char)(layer * 31 + part * 7 + block * 13 + i + 1);
}

/* dst[dst_blocks[k]] holds src block src_blocks[k] for every layer and part; a block in none of
 * `all_dst` is still zero. */
static void check_pool(const char* what, const unsigned char* pool, const int* src, const int* dst,
                       int n, const int* all_dst, int n_all) {
  for (int layer = 0; layer < LAYERS; ++layer)
    for (int part = 0; part < PARTS; ++part)
      for (int b = 0; b < BLOCKS; ++b) {
        int from = -1, sent = 0;
        for (int k = 0; k < n; ++k)
          if (dst[k] == b) from = src[k];
        for (int k = 0; k < n_all; ++k)
          if (all_dst[k] == b) sent = 1;
        for (int i = 0; i < BLOCK_BYTES; ++i) {
          unsigned char want = from >= 0 ? pattern(layer, part, from, i) : 0;
          if (from < 0 && sent) break; /* another request's block: checked there */
          if (pool[at(layer, part, b) + (size_t)i] != want) {
            char detail[128];
            snprintf(detail, sizeof detail, "layer %d part %d block %d byte %d", layer, part, b, i);
            failed(what, detail);
            return;
          }
        }
      }
}

static r2cclKvEngine_t make(const char* nics, const char* name) {
  r2cclKvEngine_t e = NULL;
  setenv("R2CCL_NICS", nics, 1);
  if (r2cclKvEngineCreate(&e, name) != r2cclSuccess) {
    fprintf(stderr, "FAIL: r2cclKvEngineCreate(%s): %s\n", name, r2cclKvGetLastError(NULL));
    exit(1);
  }
  return e;
}

static int notification(r2cclKvEngine_t e, r2cclKvNotification* note, char* payload, size_t cap) {
  for (int i = 0; i < 1000; ++i) { /* bounded: 10 s */
    int got = 0;
    if (r2cclKvGetNotification(e, note, payload, cap, &got) != r2cclSuccess) {
      failed("r2cclKvGetNotification", r2cclKvGetLastError(e));
      return 0;
    }
    if (got) return 1;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  failed("notification", "none within 10 s");
  return 0;
}

/* A span started from its initializer, as every caller starts one. */
static r2cclKvSpan kv_span(uint32_t first, uint32_t last, const uint32_t* src, const uint32_t* dst,
                           size_t n) {
  r2cclKvSpan s = R2CCL_KV_SPAN_INITIALIZER;
  s.firstLayer = first;
  s.lastLayer = last;
  s.srcBlocks = src;
  s.dstBlocks = dst;
  s.nblocks = n;
  return s;
}

int main(void) {
  r2cclKvEngine_t prefill = make("127.0.0.41,127.0.0.42", "prefill");
  r2cclKvEngine_t decode = make("127.0.0.43,127.0.0.44", "decode");
  unsigned char* src = calloc(POOL_BYTES, 1);
  unsigned char* dst = calloc(POOL_BYTES, 1);
  if (!src || !dst) return 1;
  for (int layer = 0; layer < LAYERS; ++layer)
    for (int part = 0; part < PARTS; ++part)
      for (int b = 0; b < BLOCKS; ++b)
        for (int i = 0; i < BLOCK_BYTES; ++i)
          src[at(layer, part, b) + (size_t)i] = pattern(layer, part, b, i);

  r2cclKvLayout layout = R2CCL_KV_LAYOUT_INITIALIZER;
  layout.layers = LAYERS;
  layout.blocks = BLOCKS;
  layout.blockBytes = BLOCK_BYTES;
  layout.parts = PARTS;
  void* sbuf[1] = {src};
  void* dbuf[1] = {dst};
  size_t len[1] = {POOL_BYTES};
  uint32_t spool = 99, dpool = 99;
  OK(prefill, r2cclKvRegisterPool(prefill, sbuf, len, 1, &layout, &spool));
  OK(decode, r2cclKvRegisterPool(decode, dbuf, len, 1, &layout, &dpool));

  /* The decode side's metadata, handed to the prefill side. */
  size_t mdlen = 0;
  OK(decode, r2cclKvGetMetadata(decode, NULL, &mdlen));
  unsigned char* md = malloc(mdlen);
  size_t small = 3;
  refused(decode, "metadata into a small buffer", r2cclKvGetMetadata(decode, md, &small),
          r2cclInvalidArgument, "the buffer holds 3 bytes");
  OK(decode, r2cclKvGetMetadata(decode, md, &mdlen));
  int peer = -1;
  OK(prefill, r2cclKvLoadRemote(prefill, md, mdlen, &peer));
  free(md);

  /* A whole push with a payload. */
  const uint32_t s1[3] = {1, 2, 9}, d1[3] = {10, 11, 12};
  const r2cclKvSpan span = kv_span(0, LAYERS, s1, d1, 3);
  OK(prefill, r2cclKvSubmit(prefill, 5, peer, spool, dpool, &span, 1, "first token", 11));
  r2cclKvState_t state = r2cclKvFailed;
  OK(prefill, r2cclKvWait(prefill, 5, 10000, &state));
  if (state != r2cclKvDone) failed("push", "not DONE");
  r2cclKvNotification note = R2CCL_KV_NOTIFICATION_INITIALIZER;
  char payload[64] = {0};
  /* Into 4 bytes the payload does not fit: refused, its size said, and the notification kept. */
  for (int i = 0, got = 0; i < 1000; ++i) { /* bounded: 10 s */
    const r2cclResult_t r = r2cclKvGetNotification(decode, &note, payload, 4, &got);
    if (r == r2cclSuccess && !got) {
      const struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
      continue;
    }
    refused(decode, "a payload larger than the capacity", r, r2cclInvalidArgument,
            "payload has 11 bytes, more than payloadCapacity 4; it stays queued");
    if (got || note.payloadBytes != 11 || note.request != 5)
      failed("a payload larger than the capacity", "taken, or its size not said");
    break;
  }
  if (notification(decode, &note, payload, sizeof payload)) {
    if (note.request != 5 || note.state != r2cclKvDone || note.payloadBytes != 11 ||
        memcmp(payload, "first token", 11) != 0)
      failed("notification", payload);
  }
  const int sent1[3] = {1, 2, 9}, got1[3] = {10, 11, 12}, all[5] = {10, 11, 12, 13, 14};
  check_pool("whole push", dst, sent1, got1, 3, all, 3);

  /* Layer by layer: blocks 3 and 4 into 13 and 14. */
  const uint32_t s2[2] = {3, 4}, d2[2] = {13, 14};
  OK(prefill, r2cclKvBegin(prefill, 6, peer, spool, dpool));
  for (uint32_t layer = 0; layer < LAYERS; ++layer) {
    const r2cclKvSpan one = kv_span((uint32_t)layer, (uint32_t)layer + 1, s2, d2, 2);
    OK(prefill, r2cclKvAdd(prefill, 6, &one));
  }
  OK(prefill, r2cclKvSeal(prefill, 6, NULL, 0));
  OK(prefill, r2cclKvWait(prefill, 6, 10000, &state));
  const int sent2[2] = {3, 4}, got2[2] = {13, 14};
  check_pool("layer-by-layer push", dst, sent2, got2, 2, all, 5);
  check_pool("the first push, still intact", dst, sent1, got1, 3, all, 5);
  if (notification(decode, &note, payload, sizeof payload) && note.request != 6)
    failed("second notification", "wrong request");

  /* A request cancelled after its blocks were added ends CANCELLED with every destination block
   * invalid; the list, not only its count, is reachable on both sides. */
  OK(prefill, r2cclKvBegin(prefill, 30, peer, spool, dpool));
  const r2cclKvSpan again = kv_span(0, LAYERS, s2, d2, 2);
  OK(prefill, r2cclKvAdd(prefill, 30, &again));
  OK(prefill, r2cclKvCancel(prefill, 30));
  OK(prefill, r2cclKvWait(prefill, 30, 10000, &state));
  if (state != r2cclKvCancelled) failed("cancel", "not CANCELLED");
  size_t count = 0;
  uint32_t invalid[4] = {0};
  OK(prefill, r2cclKvGetInvalidBlocks(prefill, -1, 30, NULL, 0, &count));
  if (count != 2) failed("the count of a cancelled request's invalid blocks", "not 2");
  refused(prefill, "invalid blocks into a small buffer",
          r2cclKvGetInvalidBlocks(prefill, -1, 30, invalid, 1, &count), r2cclInvalidArgument,
          "r2cclKvGetInvalidBlocks: the buffer holds 1 blocks, request 30 has 2");
  OK(prefill, r2cclKvGetInvalidBlocks(prefill, -1, 30, invalid, 4, &count));
  if (count != 2 || invalid[0] != 13 || invalid[1] != 14)
    failed("the sender's invalid blocks", "not 13 and 14");
  if (notification(decode, &note, payload, sizeof payload)) {
    if (note.request != 30 || note.state != r2cclKvCancelled || note.invalidBlocks != 2)
      failed("the cancelled request's notification", note.reason);
    memset(invalid, 0, sizeof invalid);
    OK(decode, r2cclKvGetInvalidBlocks(decode, note.peer, 30, invalid, 4, &count));
    if (count != 2 || invalid[0] != 13 || invalid[1] != 14)
      failed("the receiver's invalid blocks", "not 13 and 14");
    refused(decode, "invalid blocks of a notification never taken",
            r2cclKvGetInvalidBlocks(decode, note.peer, 31, invalid, 4, &count),
            r2cclInvalidArgument, "no notification of request 31 from peer");
  }

  /* Pull: the decode side loads the prefill side's metadata and asks for blocks 5 and 6 into 7
   * and 8 of its pool. */
  size_t plen = 0;
  OK(prefill, r2cclKvGetMetadata(prefill, NULL, &plen));
  unsigned char* pmd = malloc(plen);
  OK(prefill, r2cclKvGetMetadata(prefill, pmd, &plen));
  int back = -1;
  OK(decode, r2cclKvLoadRemote(decode, pmd, plen, &back));
  free(pmd);
  const uint32_t s3[2] = {5, 6}, d3[2] = {7, 8};
  const r2cclKvSpan pulled = kv_span(0, LAYERS, s3, d3, 2);
  OK(decode, r2cclKvPull(decode, 20, back, dpool, spool, &pulled, 1));
  state = r2cclKvFailed;
  OK(decode, r2cclKvWait(decode, 20, 10000, &state));
  if (state != r2cclKvDone) failed("pull", "not DONE");
  const int sent3[2] = {5, 6}, got3[2] = {7, 8}, all3[7] = {7, 8, 10, 11, 12, 13, 14};
  check_pool("pull", dst, sent3, got3, 2, all3, 7);
  /* The pushes the prefill side made for the pull end in notifications here, too. */
  if (notification(decode, &note, payload, sizeof payload) && note.state != r2cclKvDone)
    failed("the pull's notification", note.reason);

  /* Bad input. */
  char large[R2CCL_KV_MAX_PAYLOAD + 1] = {0};
  refused(prefill, "a payload over the limit",
          r2cclKvSubmit(prefill, 9, peer, spool, dpool, &span, 1, large, sizeof large),
          r2cclInvalidArgument, "a payload of 4097 bytes (at most 4096)");
  const uint32_t bad[1] = {99};
  const r2cclKvSpan out_of_range = kv_span(0, LAYERS, bad, d1, 1);
  refused(prefill, "a block out of range",
          r2cclKvSubmit(prefill, 7, peer, spool, dpool, &out_of_range, 1, NULL, 0),
          r2cclInvalidArgument, "source block 99 is out of range");
  refused(prefill, "no buffers", r2cclKvRegisterPool(prefill, sbuf, len, 0, &layout, &spool),
          r2cclInvalidArgument, "0 buffers");
  /* Structs not started from their initializers, or of a version or size this library does not
   * read, are refused with what was wrong. */
  r2cclKvLayout zeroed;
  memset(&zeroed, 0, sizeof zeroed);
  zeroed.layers = LAYERS;
  zeroed.blocks = BLOCKS;
  zeroed.blockBytes = BLOCK_BYTES;
  zeroed.parts = PARTS;
  refused(prefill, "a layout without its header",
          r2cclKvRegisterPool(prefill, sbuf, len, 1, &zeroed, &spool), r2cclInvalidArgument,
          "layout was not started from its initializer (magic 0x0, not R2CCL_STRUCT_MAGIC "
          "0x72326363)");
  r2cclKvSpan newer[2] = {span, span};
  newer[1].version = R2CCL_STRUCT_VERSION + 1;
  refused(prefill, "a span of a later version",
          r2cclKvSubmit(prefill, 11, peer, spool, dpool, newer, 2, NULL, 0), r2cclInvalidArgument,
          "span 1 is of version 2; this library reads version 1 to 1");
  r2cclKvSpan short_span = span;
  short_span.size = sizeof short_span - 8;
  char size_words[64];
  snprintf(size_words, sizeof size_words, "span 0.size is %zu; a version-1 one has %zu bytes",
           sizeof short_span - 8, sizeof short_span);
  refused(prefill, "a span of the wrong size", r2cclKvAdd(prefill, 12, &short_span),
          r2cclInvalidArgument, size_words);
  r2cclKvNotification blank;
  memset(&blank, 0, sizeof blank);
  int got_blank = 0;
  refused(decode, "a notification without its header",
          r2cclKvGetNotification(decode, &blank, payload, sizeof payload, &got_blank),
          r2cclInvalidArgument, "note was not started from its initializer");
  refused(prefill, "an unknown request", r2cclKvPoll(prefill, 1234, &state), r2cclInvalidArgument,
          "no request 1234");
  refused(NULL, "a NULL engine", r2cclKvCancel(NULL, 5), r2cclInvalidArgument, "engine is NULL");
  /* Still usable after the refusals. */
  OK(prefill, r2cclKvSubmit(prefill, 8, peer, spool, dpool, &span, 1, NULL, 0));
  OK(prefill, r2cclKvWait(prefill, 8, 10000, &state));
  /* A request that ended cannot be cancelled, and stays what it was. */
  refused(prefill, "cancelling a request that ended", r2cclKvCancel(prefill, 8),
          r2cclInvalidArgument, "request 8 already ended (DONE)");
  OK(prefill, r2cclKvPoll(prefill, 8, &state));
  if (state != r2cclKvDone) failed("cancel after the end", "changed the state");
  /* An unregistered pool takes no more requests. */
  OK(prefill, r2cclKvUnregisterPool(prefill, spool));
  refused(prefill, "a push from an unregistered pool",
          r2cclKvSubmit(prefill, 10, peer, spool, dpool, &span, 1, NULL, 0), r2cclInvalidArgument,
          "pool");

  /* Disconnecting ends the pair's connection: neither side reaches the other afterwards. */
  OK(decode, r2cclKvDisconnect(decode, back));
  refused(decode, "a pull from a disconnected peer",
          r2cclKvPull(decode, 21, back, dpool, spool, &pulled, 1), r2cclInvalidArgument, "peer");

  OK(prefill, r2cclKvEngineDestroy(prefill));
  OK(decode, r2cclKvEngineDestroy(decode));
  /* A destroyed engine's handle is refused, by every call, destroy included. */
  refused(NULL, "a destroyed engine's handle", r2cclKvPoll(prefill, 8, &state),
          r2cclInvalidArgument, "not a live KV engine");
  refused(NULL, "destroying an engine twice", r2cclKvEngineDestroy(decode), r2cclInvalidArgument,
          "not a live KV engine");
  free(src);
  free(dst);
  if (failures == 0) printf("capi kv: every check passed\n");
  return failures == 0 ? 0 : 1;
}
