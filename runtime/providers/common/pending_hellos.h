// The bound on connections that have not yet proven the token (review N-M6), shared by every
// listener that accepts before it authenticates: the tcp and verbs rail acceptors and rank 0's
// bootstrap root. Whoever reaches such a port can open connections and say nothing; without a
// bound they pin the process's file descriptors, or keep the legitimate peers out.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

// The rail acceptors' bounds (tcp and verbs), per provider: connections waiting for their hello
// from one source address, and in all.
constexpr std::size_t kMaxPendingHellosPerSource = 16;
constexpr std::size_t kMaxPendingHellos = 256;

// Accepted connections waiting for their hello, oldest first, counted per source address: at
// most `per_source` from one address (the next one from there is refused at once, so one host
// cannot take the room of the others) and `total` in all (the next one sheds the oldest, which
// has had the longest to say hello). One thread only (the listener's loop).
template <class Conn>
class PendingHellos {
 public:
  PendingHellos(std::size_t per_source, std::size_t total)
      : per_source_(per_source), total_(total) {}

  // Counts `conn`, accepted from `source` (an IP address), as waiting for its hello. Refused
  // (kNoResource, naming the bound and the source; the caller closes `conn` at once, and it is
  // not counted) where `source` holds `per_source` already. Otherwise, where `total` were
  // waiting, the oldest one is no longer counted and is returned for the caller to close; null
  // when none was shed.
  Result<std::shared_ptr<Conn>> admit(const std::shared_ptr<Conn>& conn,
                                      const std::string& source) {
    // A connection destroyed without settle() leaves an entry behind; its address may be reused.
    if (auto stale = where_.find(conn.get()); stale != where_.end()) erase(stale->second);
    if (from(source) >= per_source_)
      return Status(ErrorCode::kNoResource,
                    fmt::format("{} connections from {} are already waiting for their hello",
                                per_source_, source));
    std::shared_ptr<Conn> shed;
    while (!order_.empty() && order_.size() >= total_ && !shed) {
      shed = order_.front().conn.lock();
      erase(order_.begin());
    }
    order_.push_back(Entry{conn, conn.get(), source});
    where_[conn.get()] = std::prev(order_.end());
    ++by_source_[source];
    return shed;
  }

  // `conn` waits no longer: it proved the token, or it is closed. Idempotent; a connection that
  // was never admitted (or was shed) is ignored.
  void settle(const Conn* conn) {
    if (auto it = where_.find(conn); it != where_.end()) erase(it->second);
  }

  // Why a shed connection was closed.
  std::string shed_reason() const {
    return fmt::format("shed: {} connections were waiting for their hello", total_);
  }
  std::size_t size() const { return order_.size(); }
  std::size_t from(const std::string& source) const {
    auto it = by_source_.find(source);
    return it == by_source_.end() ? 0 : it->second;
  }

 private:
  struct Entry {
    std::weak_ptr<Conn> conn;
    const Conn* key;
    std::string source;
  };

  void erase(typename std::list<Entry>::iterator it) {
    if (auto s = by_source_.find(it->source); s != by_source_.end() && --s->second == 0)
      by_source_.erase(s);
    where_.erase(it->key);
    order_.erase(it);
  }

  std::size_t per_source_;
  std::size_t total_;
  std::list<Entry> order_;
  std::unordered_map<const Conn*, typename std::list<Entry>::iterator> where_;
  std::unordered_map<std::string, std::size_t> by_source_;
};

}  // namespace r2ccl
