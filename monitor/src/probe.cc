#include "r2ccl/monitor/probe.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace r2ccl::mon {
namespace {

bool is_ipv4(const std::string& text) {
  in_addr addr{};
  return inet_pton(AF_INET, text.c_str(), &addr) == 1;
}

}  // namespace

std::string ProbeSpec::peer_label() const {
  return port_given ? fmt::format("{}:{}", peer, port) : peer;
}

Result<ProbeSpec> parse_probe_spec(const std::string& text, std::uint16_t default_port) {
  auto bad = [&](std::string_view why) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("bad --probe '{}': {} (expected NIC=PEER_IPV4[:PORT], e.g. "
                              "eth1=198.18.1.2)",
                              text, why));
  };
  const auto eq = text.find('=');
  if (eq == std::string::npos) return bad("no '='");
  ProbeSpec spec;
  spec.device = text.substr(0, eq);
  std::string peer = text.substr(eq + 1);
  if (spec.device.empty()) return bad("no NIC before '='");
  if (peer.empty()) return bad("no peer address after '='");
  spec.port = default_port;
  if (const auto colon = peer.rfind(':'); colon != std::string::npos) {
    const std::string port_text = peer.substr(colon + 1);
    unsigned port = 0;
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 1 || port > 65535)
      return bad(fmt::format("port '{}' is not 1..65535", port_text));
    spec.port = static_cast<std::uint16_t>(port);
    spec.port_given = true;
    peer = peer.substr(0, colon);
  }
  if (!is_ipv4(peer)) return bad(fmt::format("'{}' is not an IPv4 address", peer));
  spec.peer = peer;
  return spec;
}

bool ProbeStats::degraded(std::size_t window_capacity) const {
  const std::size_t needed =
      std::max<std::size_t>(1, std::min(kMinProbesForVerdict, window_capacity));
  return window_count >= needed && loss_ratio >= kDegradedLossRatio;
}

ProbeWindow::ProbeWindow(std::size_t capacity, Clock::duration timeout)
    : capacity_(std::max<std::size_t>(capacity, 1)), timeout_(timeout) {}

void ProbeWindow::finish(std::optional<Clock::duration> rtt) {
  if (!rtt) ++lost_total_;
  if (rtt) last_rtt_ = rtt;
  finished_.push_back(rtt);
  while (finished_.size() > capacity_)
    finished_.pop_front();
}

void ProbeWindow::sent(std::uint64_t sequence, Clock::time_point at) {
  ++sent_total_;
  pending_[sequence] = at;
  // A reply never comes for probes past the timeout; keep the map bounded even if expire() is
  // not called (it always is): the oldest surplus entries are lost.
  const std::size_t max_pending = capacity_ * 4 + 64;
  while (pending_.size() > max_pending) {
    pending_.erase(pending_.begin());
    finish(std::nullopt);
  }
}

void ProbeWindow::send_failed(std::uint64_t sequence) {
  if (pending_.erase(sequence) == 0) ++sent_total_;  // not counted by sent() yet
  finish(std::nullopt);
}

std::optional<Clock::duration> ProbeWindow::answered(std::uint64_t sequence, Clock::time_point at) {
  auto it = pending_.find(sequence);
  if (it == pending_.end()) return std::nullopt;
  const Clock::duration rtt = std::max(at - it->second, Clock::duration::zero());
  pending_.erase(it);
  if (rtt > timeout_) {  // answered, but too late to count
    finish(std::nullopt);
    return std::nullopt;
  }
  finish(rtt);
  return rtt;
}

void ProbeWindow::expire(Clock::time_point now) {
  // Sequences grow with send time, so the oldest pending probes come first.
  while (!pending_.empty() && now - pending_.begin()->second >= timeout_) {
    pending_.erase(pending_.begin());
    finish(std::nullopt);
  }
}

ProbeStats ProbeWindow::stats() const {
  ProbeStats s;
  s.sent_total = sent_total_;
  s.lost_total = lost_total_;
  s.window_count = finished_.size();
  s.pending = pending_.size();
  double rtt_sum = 0;
  std::size_t answered = 0;
  for (const auto& r : finished_) {
    if (r) {
      rtt_sum += std::chrono::duration<double>(*r).count();
      ++answered;
    } else {
      ++s.window_lost;
    }
  }
  if (s.window_count > 0)
    s.loss_ratio = static_cast<double>(s.window_lost) / static_cast<double>(s.window_count);
  if (answered > 0) s.rtt_mean_seconds = rtt_sum / static_cast<double>(answered);
  if (last_rtt_) s.rtt_last_seconds = std::chrono::duration<double>(*last_rtt_).count();
  return s;
}

}  // namespace r2ccl::mon
