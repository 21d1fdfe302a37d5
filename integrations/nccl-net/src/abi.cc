// The tables NCCL looks up in the plugin (ncclNetPlugin_v8 .. _v12): each version's entry points
// adapted to the version-neutral core (plugin.h). NCCL 2.28 looks up v6..v11, NCCL 2.32 v6..v12;
// a NCCL takes the newest it knows.
#include <cstring>

#include "plugin.h"

namespace net = r2ccl::ncclnet;

namespace {

template <typename Props>
void fill_common(const net::DeviceProperties& p, Props* out) {
  out->name = const_cast<char*>(p.name);
  out->pciPath = const_cast<char*>(p.pci_path);
  out->guid = p.guid;
  out->ptrSupport = p.ptr_support;
  out->regIsGlobal = 0;
  out->speed = p.speed_mbps;
  out->port = 0;
  out->latency = 0;
  out->maxComms = p.max_comms;
  out->maxRecvs = p.max_recvs;
  out->netDeviceType = NCCL_NET_DEVICE_HOST;
  out->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
}

// v9 and later: a virtual device of its one physical device, and transfer size limits.
template <typename Props>
void fill_v9(const net::DeviceProperties& p, Props* out) {
  fill_common(p, out);
  out->forceFlush = 0;
  out->vProps.ndevs = 1;
  out->vProps.devs[0] = 0;
  out->maxP2pBytes = p.max_bytes;
  out->maxCollBytes = p.max_bytes;
}

template <typename Props, typename Fill>
ncclResult_t get_properties(int dev, Props* props, Fill fill) {
  if (props == nullptr) return ncclInvalidArgument;
  std::memset(static_cast<void*>(props), 0, sizeof *props);
  net::DeviceProperties p;
  if (const ncclResult_t r = net::properties(dev, &p); r != ncclSuccess) return r;
  fill(p, props);
  return ncclSuccess;
}

ncclResult_t props_v12(int dev, ncclNetProperties_v12_t* props) {
  return get_properties(dev, props, [](const auto& p, auto* out) {
    fill_v9(p, out);
    out->maxMultiRequestSize = 1;
    out->railId = NCCL_NET_ID_UNDEF;
    out->planeId = NCCL_NET_ID_UNDEF;
  });
}
ncclResult_t props_v11(int dev, ncclNetProperties_v11_t* props) {
  return get_properties(dev, props, [](const auto& p, auto* out) {
    fill_v9(p, out);
    out->maxMultiRequestSize = 1;
  });
}
ncclResult_t props_v10(int dev, ncclNetProperties_v10_t* props) {
  return get_properties(dev, props, [](const auto& p, auto* out) { fill_v9(p, out); });
}
ncclResult_t props_v9(int dev, ncclNetProperties_v9_t* props) {
  return get_properties(dev, props, [](const auto& p, auto* out) { fill_v9(p, out); });
}
ncclResult_t props_v8(int dev, ncclNetProperties_v8_t* props) {
  return get_properties(dev, props, [](const auto& p, auto* out) { fill_common(p, out); });
}

// v11 and v12: a context per NCCL communicator.
ncclResult_t init_ctx(void** ctx, uint64_t, ncclNetCommConfig_v11_t*, ncclDebugLogger_t logger,
                      ncclProfilerCallback_t) {
  return net::init(logger, ctx);
}
ncclResult_t init_v12(void** ctx, uint64_t comm_id, ncclNetCommConfig_v12_t* config,
                      ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  return init_ctx(ctx, comm_id, reinterpret_cast<ncclNetCommConfig_v11_t*>(config), logger, prof);
}
ncclResult_t init_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t) {
  return net::init(logger, nullptr);
}
ncclResult_t init_v8(ncclDebugLogger_t logger) {
  return net::init(logger, nullptr);
}

ncclResult_t listen_ctx(void*, int dev, void* handle, void** listen_comm) {
  return net::listen(dev, handle, listen_comm);
}
ncclResult_t connect_ctx(void*, int dev, void* handle, void** send_comm,
                         ncclNetDeviceHandle_v11_t**) {
  return net::connect(dev, handle, send_comm);
}
ncclResult_t connect_v10(int dev, ncclNetCommConfig_v10_t*, void* handle, void** send_comm,
                         ncclNetDeviceHandle_v10_t**) {
  return net::connect(dev, handle, send_comm);
}
ncclResult_t connect_v8(int dev, void* handle, void** send_comm, ncclNetDeviceHandle_v8_t**) {
  return net::connect(dev, handle, send_comm);
}
ncclResult_t accept_any(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_v8_t**) {
  return net::accept(listen_comm, recv_comm);
}

ncclResult_t isend_ph(void* comm, void* data, size_t size, int tag, void* mh, void*, void** req) {
  return net::isend(comm, data, size, tag, mh, req);
}
ncclResult_t isend_v9(void* comm, void* data, size_t size, int tag, void* mh, void** req) {
  return net::isend(comm, data, size, tag, mh, req);
}
ncclResult_t isend_v8(void* comm, void* data, int size, int tag, void* mh, void** req) {
  if (size < 0) return ncclInvalidArgument;
  return net::isend(comm, data, static_cast<size_t>(size), tag, mh, req);
}
ncclResult_t irecv_ph(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhs, void**,
                      void** req) {
  return net::irecv(comm, n, data, sizes, tags, mhs, req);
}
ncclResult_t irecv_v9(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhs,
                      void** req) {
  return net::irecv(comm, n, data, sizes, tags, mhs, req);
}
ncclResult_t irecv_v8(void* comm, int n, void** data, int* sizes, int* tags, void** mhs,
                      void** req) {
  if (n < 1 || n > net::kMaxRecvs || sizes == nullptr) return ncclInvalidArgument;
  size_t wide[net::kMaxRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) return ncclInvalidArgument;
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return net::irecv(comm, n, data, wide, tags, mhs, req);
}
ncclResult_t iflush(void* comm, int n, void** data, int* sizes, void** mhs, void** req) {
  return net::iflush(comm, n, data, sizes, mhs, req);
}
ncclResult_t devices(int* ndev) {
  return net::devices(ndev);
}

}  // namespace

extern "C" {

#define R2CCL_NET_COMMON(props, init, listen, connect, isend, irecv)                           \
  "r2ccl", init, devices, props, listen, connect, accept_any, net::reg_mr, net::reg_mr_dmabuf, \
      net::dereg_mr, isend, irecv, iflush, net::test, net::close_send, net::close_recv,        \
      net::close_listen, nullptr /* getDeviceMr */, nullptr /* irecvConsumed */

ncclNet_v12_t ncclNetPlugin_v12 = {
    R2CCL_NET_COMMON(props_v12, init_v12, listen_ctx, connect_ctx, isend_ph, irecv_ph),
    nullptr /* makeVDevice */, net::finalize, nullptr /* setNetAttr */};

ncclNet_v11_t ncclNetPlugin_v11 = {
    R2CCL_NET_COMMON(props_v11, init_ctx, listen_ctx, connect_ctx, isend_ph, irecv_ph),
    nullptr /* makeVDevice */, net::finalize, nullptr /* setNetAttr */};

ncclNet_v10_t ncclNetPlugin_v10 = {
    R2CCL_NET_COMMON(props_v10, init_v10, net::listen, connect_v10, isend_ph, irecv_ph),
    nullptr /* makeVDevice */};

ncclNet_v9_t ncclNetPlugin_v9 = {
    R2CCL_NET_COMMON(props_v9, init_v8, net::listen, connect_v8, isend_v9, irecv_v9),
    nullptr /* makeVDevice */};

ncclNet_v8_t ncclNetPlugin_v8 = {
    R2CCL_NET_COMMON(props_v8, init_v8, net::listen, connect_v8, isend_v8, irecv_v8)};

#undef R2CCL_NET_COMMON

}  // extern "C"
