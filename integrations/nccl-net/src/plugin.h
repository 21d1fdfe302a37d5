// r2ccl as an NCCL network plugin: the version-neutral core behind the ncclNet_vN_t tables that
// abi.cc exports.
//
// One process-wide r2ccl endpoint carries every NCCL connection of the process: NCCL's
// connections are unidirectional (a send comm here, a receive comm at the peer) and many run
// between the same two processes, so they share the endpoint's multi-rail channel to that peer
// and are told apart by comm ids in the plugin's messages.
//
// Data moves receiver-driven, as NCCL's own InfiniBand transport does: irecv sends the sender a
// clear-to-send naming its registered buffer; isend takes the oldest clear-to-send and writes its
// data into that buffer with the endpoint's one-sided write (striped over every rail, replayed
// on a surviving rail when one fails), then tells the receiver the size with a message that the
// endpoint delivers after the write's bytes. Small sends travel inside that message instead.
// A request completes only when every byte is in the receiver's memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "net.h"  // NCCL's plugin headers (third_party/nccl)

namespace r2ccl::ncclnet {

// What getProperties reports, before each ABI version's struct is filled from it.
struct DeviceProperties {
  const char* name = nullptr;
  const char* pci_path = nullptr;
  std::uint64_t guid = 0;
  int ptr_support = NCCL_PTR_HOST;
  int speed_mbps = 0;
  int max_comms = 0;
  int max_recvs = 0;
  std::size_t max_bytes = 0;
};

inline constexpr int kMaxRecvs = 8;
inline constexpr std::size_t kMaxRequests = NCCL_NET_MAX_REQUESTS;

// Each entry point of the ABI, version-neutral. None throws; errors are logged through NCCL's
// logger (a WARN naming what was wrong) and returned as NCCL's codes.
ncclResult_t init(ncclDebugLogger_t logger, void** ctx);
ncclResult_t finalize(void* ctx);
ncclResult_t devices(int* ndev);
ncclResult_t properties(int dev, DeviceProperties* props);
ncclResult_t listen(int dev, void* handle, void** listen_comm);
ncclResult_t connect(int dev, void* handle, void** send_comm);
ncclResult_t accept(void* listen_comm, void** recv_comm);
ncclResult_t reg_mr(void* comm, void* data, std::size_t size, int type, void** mhandle);
ncclResult_t reg_mr_dmabuf(void* comm, void* data, std::size_t size, int type, std::uint64_t offset,
                           int fd, void** mhandle);
ncclResult_t dereg_mr(void* comm, void* mhandle);
ncclResult_t isend(void* send_comm, void* data, std::size_t size, int tag, void* mhandle,
                   void** request);
ncclResult_t irecv(void* recv_comm, int n, void** data, const std::size_t* sizes, const int* tags,
                   void** mhandles, void** request);
ncclResult_t iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                    void** request);
ncclResult_t test(void* request, int* done, int* sizes);
ncclResult_t close_send(void* send_comm);
ncclResult_t close_recv(void* recv_comm);
ncclResult_t close_listen(void* listen_comm);

}  // namespace r2ccl::ncclnet
