// Watches the kernel's link state (rtnetlink, RTMGRP_LINK) on the progress thread and reports
// every change of an interface's operational state (IFF_RUNNING: up with carrier). A NIC that
// is set down, or whose cable/peer goes away, is known within the time the kernel takes to
// say so — no polling.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

class ProgressEngine;

class LinkWatcher {
 public:
  using Handler = std::function<void(const std::string& ifname, bool running)>;
  // Starts watching; the handler runs on the progress thread for each change.
  static Result<std::unique_ptr<LinkWatcher>> start(ProgressEngine& engine, Handler handler);
  virtual ~LinkWatcher() = default;
  // Stops delivery (progress thread or not); no handler runs after it returns.
  virtual void stop() = 0;
  // How many times the kernel dropped link events (ENOBUFS, a storm that filled the socket's
  // buffer) and the watcher re-read every interface's state instead (each time it logs a
  // warning saying so).
  virtual std::uint64_t resyncs() const = 0;
};

// Reads one buffer of rtnetlink messages (as the kernel sent them, `n` bytes) and calls `each`
// for every link message that names an interface: its name and whether it is up and running.
// Every length is checked against the buffer before use.
void parse_link_messages(const char* buffer, std::size_t n,
                         const std::function<void(const std::string& ifname, bool running)>& each);

// The current operational state of an interface (IFF_RUNNING), or an error if it does not exist.
Result<bool> interface_running(const std::string& ifname);

}  // namespace r2ccl
