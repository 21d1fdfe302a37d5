// The KV-cache engine's C ABI (r2cclKv* in include/r2ccl.h): an engine on an endpoint of its
// own, as a prefill or decode server uses it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "abi.h"
#include "r2ccl.h"
#include "r2ccl/kv/engine.h"
#if R2CCL_WITH_METRICS
#include "r2ccl/monitor/job_metrics.h"
#endif
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/log.h"

using r2ccl::ErrorCode;
using r2ccl::Status;
namespace kv = r2ccl::kv;

// The handle: a cell of the handle table, never reused (abi.h, HandleTable).
struct r2cclKvEngine {
  std::uint64_t serial;
};

namespace {
struct KvState {
  // Declared in this order so that the engine goes before the endpoint it runs on.
  std::unique_ptr<r2ccl::Endpoint> endpoint;
  std::unique_ptr<kv::KvEngine> engine;
  r2ccl::capi::ErrorSlot errors;
  std::mutex notes_mutex;
  std::deque<kv::Notification> notes;  // taken from the engine, not yet from the caller
  // The invalid blocks of the last notifications the caller took (r2cclKvGetInvalidBlocks),
  // newest last; bounded in count and in block ids. Under notes_mutex.
  struct Taken {
    int peer;
    std::uint64_t request;
    std::vector<std::uint32_t> invalid_blocks;
  };
  std::deque<Taken> taken;
  std::size_t taken_blocks = 0;
#if R2CCL_WITH_METRICS
  // R2CCL_METRICS_PORT (+ LOCAL_RANK): the engine's rail metrics; last, so that it goes first.
  std::unique_ptr<r2ccl::mon::JobMetrics> metrics;
#endif
};

using Engines = r2ccl::capi::HandleTable<r2cclKvEngine, KvState>;

// Bounds on what a caller's counts may ask for before anything is allocated.
constexpr std::uint64_t kMaxPlaces = 1u << 20;  // layers x parts
constexpr std::size_t kMaxBuffers = 1u << 16;   // buffers of one pool
constexpr std::size_t kMaxSpans = 1u << 20;     // spans of one request
constexpr std::size_t kMaxBlocks = 1u << 24;    // blocks of one request, all spans together
static_assert(R2CCL_KV_MAX_PAYLOAD == kv::kMaxPayloadBytes);
constexpr std::size_t kTakenKept = 1024;            // notifications kept for their blocks
constexpr std::size_t kTakenBlocksKept = 1u << 20;  // block ids kept for them, all together

r2ccl::capi::ErrorSlot* slot(KvState* e) {
  return e != nullptr ? &e->errors : nullptr;
}

r2cclResult_t fail(KvState* e, r2cclResult_t result, std::string message) {
  return r2ccl::capi::fail(slot(e), result, std::move(message));
}
r2cclResult_t fail(KvState* e, const Status& st) {
  return r2ccl::capi::fail(slot(e), st);
}
r2cclResult_t done(KvState* e, const Status& st) {
  return st.is_ok() ? r2cclSuccess : fail(e, st);
}

// Every entry point: the guard, and the engine looked up and held while `body` runs.
template <typename F>
r2cclResult_t entry(const r2cclKvEngine* handle, const char* what, F&& body) {
  return r2ccl::capi::guarded(nullptr, what, [&]() -> r2cclResult_t {
    if (handle == nullptr)
      return fail(nullptr, r2cclInvalidArgument, fmt::format("{}: engine is NULL", what));
    const std::shared_ptr<KvState> e = Engines::instance().find(handle);
    if (!e)
      return fail(nullptr, r2cclInvalidArgument,
                  fmt::format("{}: engine is not a live KV engine (destroyed, or never made by "
                              "r2ccl)",
                              what));
    return body(e.get());
  });
}

// A struct the caller passed: started from its initializer, of a version this library reads,
// and of that version's size (r2ccl.h, R2CCL_STRUCT_MAGIC). `index`: its place in an array.
template <typename T>
Status check_header(const T& s, std::string_view kind, std::ptrdiff_t index = -1) {
  if (s.magic == R2CCL_STRUCT_MAGIC && s.version >= 1 && s.version <= R2CCL_STRUCT_VERSION &&
      s.size == sizeof(T))
    return Status::ok();
  const std::string what = index < 0 ? std::string(kind) : fmt::format("{} {}", kind, index);
  if (s.magic != R2CCL_STRUCT_MAGIC)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} was not started from its initializer (magic {:#x}, not "
                              "R2CCL_STRUCT_MAGIC {:#x})",
                              what, s.magic, R2CCL_STRUCT_MAGIC));
  if (s.version == 0 || s.version > R2CCL_STRUCT_VERSION)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} is of version {}; this library reads version 1 to {}", what,
                              s.version, R2CCL_STRUCT_VERSION));
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("{}.size is {}; a version-{} one has {} bytes", what, s.size, s.version,
                            sizeof(T)));
}

r2ccl::Result<kv::KvLayout> layout_of(const r2cclKvLayout* l) {
  if (l == nullptr) return Status(ErrorCode::kInvalidArgument, "layout is NULL");
  R2CCL_RETURN_IF_ERROR(check_header(*l, "layout"));
  const std::uint64_t places = static_cast<std::uint64_t>(l->layers) * l->parts;
  if (places == 0 || places > kMaxPlaces)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("layout: {} layers x {} parts (1 to {} places)", l->layers, l->parts,
                              kMaxPlaces));
  if (l->places == nullptr)
    return kv::KvLayout::layer_major(l->layers, l->blocks, l->blockBytes, l->parts);
  kv::KvLayout out{l->layers, l->blocks, l->blockBytes, l->parts, {}};
  out.places.reserve(places);
  for (std::uint64_t i = 0; i < places; ++i)
    out.places.push_back({l->places[i].buffer, l->places[i].offset, l->places[i].stride});
  return out;
}

// One span whose header spans_of() checked.
r2ccl::Result<kv::BlockSpan> span_of(const r2cclKvSpan& s, std::size_t index) {
  if (s.nblocks > kMaxBlocks)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("span {}: {} blocks (at most {})", index, s.nblocks, kMaxBlocks));
  if (s.nblocks > 0 && (s.srcBlocks == nullptr || s.dstBlocks == nullptr))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("span {}: srcBlocks or dstBlocks is NULL", index));
  kv::BlockSpan out;
  out.first_layer = s.firstLayer;
  out.last_layer = s.lastLayer;
  if (s.nblocks > 0) {
    out.src_blocks.assign(s.srcBlocks, s.srcBlocks + s.nblocks);
    out.dst_blocks.assign(s.dstBlocks, s.dstBlocks + s.nblocks);
  }
  return out;
}

r2ccl::Result<std::vector<kv::BlockSpan>> spans_of(const r2cclKvSpan* spans, std::size_t n) {
  if (n > kMaxSpans)
    return Status(ErrorCode::kInvalidArgument, fmt::format("{} spans (at most {})", n, kMaxSpans));
  if (n > 0 && spans == nullptr) return Status(ErrorCode::kInvalidArgument, "spans is NULL");
  std::size_t blocks = 0;
  for (std::size_t i = 0; i < n; ++i) {
    R2CCL_RETURN_IF_ERROR(check_header(spans[i], "span", static_cast<std::ptrdiff_t>(i)));
    blocks += std::min(spans[i].nblocks, kMaxBlocks + 1);
    if (blocks > kMaxBlocks)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("spans 0..{} hold more than {} blocks", i, kMaxBlocks));
  }
  std::vector<kv::BlockSpan> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    R2CCL_ASSIGN_OR_RETURN(auto s, span_of(spans[i], i));
    out.push_back(std::move(s));
  }
  return out;
}

r2ccl::Result<r2ccl::Bytes> payload_of(const void* p, std::size_t n) {
  if (n > R2CCL_KV_MAX_PAYLOAD)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("a payload of {} bytes (at most {})", n, R2CCL_KV_MAX_PAYLOAD));
  if (n > 0 && p == nullptr) return Status(ErrorCode::kInvalidArgument, "payload is NULL");
  const auto* b = static_cast<const std::byte*>(p);
  return n > 0 ? r2ccl::Bytes(b, b + n) : r2ccl::Bytes();
}

r2cclKvState_t state_of(kv::RequestState s) {
  switch (s) {
    case kv::RequestState::kPending:
      return r2cclKvPending;
    case kv::RequestState::kInFlight:
      return r2cclKvInFlight;
    case kv::RequestState::kDone:
      return r2cclKvDone;
    case kv::RequestState::kFailed:
      return r2cclKvFailed;
    case kv::RequestState::kCancelled:
      return r2cclKvCancelled;
  }
  return r2cclKvFailed;
}

// A request's state as a result: DONE and CANCELLED succeed, FAILED is a remote error naming
// why, PENDING and IN_FLIGHT are in progress.
r2cclResult_t report(KvState* e, std::uint64_t id, const kv::RequestStatus& st,
                     r2cclKvState_t* state) {
  *state = state_of(st.state);
  switch (st.state) {
    case kv::RequestState::kDone:
    case kv::RequestState::kCancelled:
      return r2cclSuccess;
    case kv::RequestState::kPending:
    case kv::RequestState::kInFlight:
      return r2cclInProgress;
    case kv::RequestState::kFailed:
      break;
  }
  return fail(e, r2cclRemoteError, fmt::format("request {} failed: {}", id, st.reason));
}

}  // namespace

extern "C" {

r2cclResult_t r2cclKvEngineCreate(r2cclKvEngine_t* engine, const char* name) {
  return r2ccl::capi::guarded(nullptr, "r2cclKvEngineCreate", [&] {
    if (engine == nullptr)
      return fail(nullptr, r2cclInvalidArgument, "r2cclKvEngineCreate: engine is NULL");
    *engine = nullptr;
    auto config = r2ccl::parse_config(r2ccl::process_env());
    if (!config) return fail(nullptr, config.status().with_context("r2cclKvEngineCreate"));
    if (config->log_level > r2ccl::LogLevel::kWarn) r2ccl::set_log_level(config->log_level);
    r2ccl::EndpointOptions options;
    if (name != nullptr) options.name = name;
    auto e = std::make_shared<KvState>();
    auto endpoint = r2ccl::Endpoint::create(*config, options);
    if (!endpoint) return fail(nullptr, endpoint.status().with_context("r2cclKvEngineCreate"));
    e->endpoint = std::move(*endpoint);
    auto made = kv::KvEngine::create(*e->endpoint, kv::EngineOptions::from(*config));
    if (!made) return fail(nullptr, made.status().with_context("r2cclKvEngineCreate"));
    e->engine = std::move(*made);
#if R2CCL_WITH_METRICS
    const char* local_rank = std::getenv("LOCAL_RANK");
    const int offset = local_rank != nullptr ? std::clamp(std::atoi(local_rank), 0, 4096) : 0;
    e->metrics = r2ccl::mon::JobMetrics::start(*config, *e->endpoint, offset,
                                               name != nullptr ? name : e->endpoint->name());
#else
    if (config->metrics_port)
      R2CCL_WARN("R2CCL_METRICS_PORT is set, but this libr2ccl was built without metrics");
#endif
    *engine = Engines::instance().add(std::move(e));
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclKvEngineDestroy(r2cclKvEngine_t engine) {
  return r2ccl::capi::guarded(nullptr, "r2cclKvEngineDestroy", [&] {
    if (engine == nullptr) return r2cclSuccess;
    // Gone from the table at once; freed with the last call still inside it.
    if (!Engines::instance().remove(engine))
      return fail(nullptr, r2cclInvalidArgument,
                  "r2cclKvEngineDestroy: engine is not a live KV engine (destroyed, or never made "
                  "by r2ccl)");
    return r2cclSuccess;
  });
}

const char* r2cclKvGetLastError(r2cclKvEngine_t engine) {
  const std::shared_ptr<KvState> e = engine != nullptr ? Engines::instance().find(engine) : nullptr;
  return r2ccl::capi::last_error(slot(e.get()));
}

r2cclResult_t r2cclKvRegisterPool(r2cclKvEngine_t handle, void* const* buffers,
                                  const size_t* lengths, int nbuffers, const r2cclKvLayout* layout,
                                  uint32_t* pool) {
  return entry(handle, "r2cclKvRegisterPool", [&](KvState* engine) {
    const char* what = "r2cclKvRegisterPool";
    if (pool == nullptr)
      return fail(engine, r2cclInvalidArgument, "r2cclKvRegisterPool: pool is NULL");
    if (nbuffers <= 0 || static_cast<std::size_t>(nbuffers) > kMaxBuffers)
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("{}: {} buffers (1 to {})", what, nbuffers, kMaxBuffers));
    if (buffers == nullptr || lengths == nullptr)
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("{}: buffers or lengths is NULL", what));
    std::vector<std::span<std::byte>> spans;
    for (int i = 0; i < nbuffers; ++i) {
      if (buffers[i] == nullptr || lengths[i] == 0)
        return fail(engine, r2cclInvalidArgument,
                    fmt::format("{}: buffer {} is NULL or empty", what, i));
      spans.emplace_back(static_cast<std::byte*>(buffers[i]), lengths[i]);
    }
    auto l = layout_of(layout);
    if (!l) return fail(engine, l.status().with_context(what));
    auto p = engine->engine->register_pool(spans, *l);
    if (!p) return fail(engine, p.status().with_context(what));
    *pool = *p;
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclKvUnregisterPool(r2cclKvEngine_t handle, uint32_t pool) {
  return entry(handle, "r2cclKvUnregisterPool", [&](KvState* engine) {
    return done(engine, engine->engine->unregister_pool(pool));
  });
}

r2cclResult_t r2cclKvGetMetadata(r2cclKvEngine_t handle, void* buf, size_t* len) {
  return entry(handle, "r2cclKvGetMetadata", [&](KvState* engine) {
    if (len == nullptr)
      return fail(engine, r2cclInvalidArgument, "r2cclKvGetMetadata: len is NULL");
    const r2ccl::Bytes md = engine->engine->metadata();
    const std::size_t capacity = *len;
    *len = md.size();
    if (buf == nullptr) return r2cclSuccess;
    if (capacity < md.size())
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("r2cclKvGetMetadata: the buffer holds {} bytes, the metadata is {}",
                              capacity, md.size()));
    std::memcpy(buf, md.data(), md.size());
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclKvLoadRemote(r2cclKvEngine_t handle, const void* metadata, size_t len,
                                int* peer) {
  return entry(handle, "r2cclKvLoadRemote", [&](KvState* engine) {
    if (peer == nullptr || metadata == nullptr)
      return fail(engine, r2cclInvalidArgument, "r2cclKvLoadRemote: metadata or peer is NULL");
    auto p = engine->engine->load_remote(
        std::span<const std::byte>(static_cast<const std::byte*>(metadata), len));
    if (!p) return fail(engine, p.status().with_context("r2cclKvLoadRemote"));
    *peer = *p;
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclKvDisconnect(r2cclKvEngine_t handle, int peer) {
  return entry(handle, "r2cclKvDisconnect",
               [&](KvState* engine) { return done(engine, engine->engine->disconnect(peer)); });
}

r2cclResult_t r2cclKvSubmit(r2cclKvEngine_t handle, uint64_t id, int peer, uint32_t localPool,
                            uint32_t remotePool, const r2cclKvSpan* spans, size_t nspans,
                            const void* payload, size_t payloadBytes) {
  return entry(handle, "r2cclKvSubmit", [&](KvState* engine) {
    auto s = spans_of(spans, nspans);
    if (!s) return fail(engine, s.status().with_context("r2cclKvSubmit"));
    auto p = payload_of(payload, payloadBytes);
    if (!p) return fail(engine, p.status().with_context("r2cclKvSubmit"));
    return done(engine, engine->engine->submit(id, peer, localPool, remotePool, *s, std::move(*p))
                            .with_context("r2cclKvSubmit"));
  });
}

r2cclResult_t r2cclKvBegin(r2cclKvEngine_t handle, uint64_t id, int peer, uint32_t localPool,
                           uint32_t remotePool) {
  return entry(handle, "r2cclKvBegin", [&](KvState* engine) {
    return done(
        engine,
        engine->engine->begin(id, peer, localPool, remotePool).with_context("r2cclKvBegin"));
  });
}

r2cclResult_t r2cclKvAdd(r2cclKvEngine_t handle, uint64_t id, const r2cclKvSpan* span) {
  return entry(handle, "r2cclKvAdd", [&](KvState* engine) {
    if (span == nullptr) return fail(engine, r2cclInvalidArgument, "r2cclKvAdd: span is NULL");
    auto s = spans_of(span, 1);
    if (!s) return fail(engine, s.status().with_context("r2cclKvAdd"));
    return done(engine, engine->engine->add(id, s->front()).with_context("r2cclKvAdd"));
  });
}

r2cclResult_t r2cclKvSeal(r2cclKvEngine_t handle, uint64_t id, const void* payload,
                          size_t payloadBytes) {
  return entry(handle, "r2cclKvSeal", [&](KvState* engine) {
    auto p = payload_of(payload, payloadBytes);
    if (!p) return fail(engine, p.status().with_context("r2cclKvSeal"));
    return done(engine, engine->engine->seal(id, std::move(*p)).with_context("r2cclKvSeal"));
  });
}

r2cclResult_t r2cclKvPull(r2cclKvEngine_t handle, uint64_t id, int peer, uint32_t localPool,
                          uint32_t remotePool, const r2cclKvSpan* spans, size_t nspans) {
  return entry(handle, "r2cclKvPull", [&](KvState* engine) {
    auto s = spans_of(spans, nspans);
    if (!s) return fail(engine, s.status().with_context("r2cclKvPull"));
    return done(
        engine,
        engine->engine->pull(id, peer, localPool, remotePool, *s).with_context("r2cclKvPull"));
  });
}

r2cclResult_t r2cclKvPoll(r2cclKvEngine_t handle, uint64_t id, r2cclKvState_t* state) {
  return entry(handle, "r2cclKvPoll", [&](KvState* engine) {
    if (state == nullptr) return fail(engine, r2cclInvalidArgument, "r2cclKvPoll: state is NULL");
    auto st = engine->engine->status(id);
    if (!st) return fail(engine, st.status().with_context("r2cclKvPoll"));
    return report(engine, id, *st, state);
  });
}

r2cclResult_t r2cclKvWait(r2cclKvEngine_t handle, uint64_t id, int timeoutMs,
                          r2cclKvState_t* state) {
  return entry(handle, "r2cclKvWait", [&](KvState* engine) {
    if (state == nullptr) return fail(engine, r2cclInvalidArgument, "r2cclKvWait: state is NULL");
    if (timeoutMs < 0)
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("r2cclKvWait: timeoutMs is {} (0 or more)", timeoutMs));
    auto st = engine->engine->wait(id, std::chrono::milliseconds(timeoutMs));
    if (!st) {
      if (auto now = engine->engine->status(id)) *state = state_of(now->state);
      return fail(engine, st.status().with_context("r2cclKvWait"));
    }
    return report(engine, id, *st, state);
  });
}

r2cclResult_t r2cclKvCancel(r2cclKvEngine_t handle, uint64_t id) {
  return entry(handle, "r2cclKvCancel", [&](KvState* engine) {
    return done(engine, engine->engine->cancel(id).with_context("r2cclKvCancel"));
  });
}

r2cclResult_t r2cclKvGetNotification(r2cclKvEngine_t handle, r2cclKvNotification* note,
                                     void* payload, size_t payloadCapacity, int* got) {
  return entry(handle, "r2cclKvGetNotification", [&](KvState* engine) {
    if (note == nullptr || got == nullptr)
      return fail(engine, r2cclInvalidArgument, "r2cclKvGetNotification: note or got is NULL");
    if (payloadCapacity > 0 && payload == nullptr)
      return fail(engine, r2cclInvalidArgument,
                  "r2cclKvGetNotification: payload is NULL with a capacity");
    *got = 0;
    if (Status st = check_header(*note, "note"); !st)
      return fail(engine, st.with_context("r2cclKvGetNotification"));
    std::lock_guard lock(engine->notes_mutex);
    // The engine's own queue is bounded; this one holds at most what it handed over at once.
    if (engine->notes.empty())
      for (auto& n : engine->engine->poll_notifications())
        engine->notes.push_back(std::move(n));
    if (engine->notes.empty()) return r2cclSuccess;
    const kv::Notification& n = engine->notes.front();
    note->request = n.request;
    note->peer = n.peer;
    note->state = state_of(n.state);
    note->verified = n.verified ? 1 : 0;
    note->payloadBytes = n.payload.size();
    note->invalidBlocks = n.invalid_blocks.size();
    const std::size_t reason = std::min(n.reason.size(), sizeof note->reason - 1);
    std::memcpy(note->reason, n.reason.data(), reason);
    note->reason[reason] = '\0';
    if (n.payload.size() > payloadCapacity)
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("r2cclKvGetNotification: request {}'s payload has {} bytes, more "
                              "than payloadCapacity {}; it stays queued",
                              n.request, n.payload.size(), payloadCapacity));
    if (!n.payload.empty()) std::memcpy(payload, n.payload.data(), n.payload.size());
    engine->taken_blocks += n.invalid_blocks.size();
    engine->taken.push_back({n.peer, n.request, n.invalid_blocks});
    while (engine->taken.size() > kTakenKept ||
           (engine->taken.size() > 1 && engine->taken_blocks > kTakenBlocksKept)) {
      engine->taken_blocks -= engine->taken.front().invalid_blocks.size();
      engine->taken.pop_front();
    }
    engine->notes.pop_front();
    *got = 1;
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclKvGetInvalidBlocks(r2cclKvEngine_t handle, int peer, uint64_t request,
                                      uint32_t* blocks, size_t capacity, size_t* count) {
  return entry(handle, "r2cclKvGetInvalidBlocks", [&](KvState* engine) {
    const char* what = "r2cclKvGetInvalidBlocks";
    if (count == nullptr)
      return fail(engine, r2cclInvalidArgument, fmt::format("{}: count is NULL", what));
    std::vector<std::uint32_t> list;
    if (peer < 0) {
      auto st = engine->engine->status(request);
      if (!st) return fail(engine, st.status().with_context(what));
      list = std::move(st->invalid_blocks);
    } else {
      std::lock_guard lock(engine->notes_mutex);
      auto it = std::find_if(engine->taken.rbegin(), engine->taken.rend(),
                             [&](const auto& t) { return t.peer == peer && t.request == request; });
      if (it == engine->taken.rend())
        return fail(engine, r2cclInvalidArgument,
                    fmt::format("{}: no notification of request {} from peer {} was taken (the "
                                "last {} taken are kept)",
                                what, request, peer, kTakenKept));
      list = it->invalid_blocks;
    }
    *count = list.size();
    if (blocks == nullptr) return r2cclSuccess;
    if (capacity < list.size())
      return fail(engine, r2cclInvalidArgument,
                  fmt::format("{}: the buffer holds {} blocks, request {} has {}", what, capacity,
                              request, list.size()));
    std::copy(list.begin(), list.end(), blocks);
    return r2cclSuccess;
  });
}

}  // extern "C"
