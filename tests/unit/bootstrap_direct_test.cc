// The bootstrap's direct path (a world's rails, here an in-process queue): control messages taken
// once each and in order whichever path brings them, and all-gathers that complete while rank 0
// is silent (its connection to one rank black-holed by a proxy that holds every byte).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "bootstrap/inbox.h"
#include "r2ccl/runtime/bootstrap.h"
#include "test_util.h"

namespace r2ccl {
namespace {

using bootstrap_wire::InOrderInbox;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

Bytes number(std::uint32_t n) {
  return ByteWriter().u32(n).take();
}
std::uint32_t number_of(const Bytes& b) {
  ByteReader r(b);
  return r.u32();
}

TEST(InOrderInbox, EachMessageOnceInTheSendersOrderWhicheverPathBringsItFirst) {
  InOrderInbox inbox;
  std::vector<std::uint32_t> got;
  auto take = [&](std::uint64_t seq) {
    return inbox.accept(seq, number(static_cast<std::uint32_t>(seq)),
                        [&](Bytes m) { got.push_back(number_of(m)); });
  };
  // The rails bring 1, 2, then 4 and 5 (3's copy there was lost); the relay brings 1..5 later.
  EXPECT_EQ(take(1), InOrderInbox::Outcome::kDelivered);
  EXPECT_EQ(take(2), InOrderInbox::Outcome::kDelivered);
  EXPECT_EQ(take(4), InOrderInbox::Outcome::kHeld);
  EXPECT_EQ(take(5), InOrderInbox::Outcome::kHeld);
  EXPECT_EQ(take(4), InOrderInbox::Outcome::kDuplicate);
  EXPECT_EQ(got, (std::vector<std::uint32_t>{1, 2}));
  EXPECT_EQ(take(1), InOrderInbox::Outcome::kDuplicate);
  EXPECT_EQ(take(2), InOrderInbox::Outcome::kDuplicate);
  EXPECT_EQ(take(3), InOrderInbox::Outcome::kDelivered);
  EXPECT_EQ(got, (std::vector<std::uint32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(take(4), InOrderInbox::Outcome::kDuplicate);
  EXPECT_EQ(take(5), InOrderInbox::Outcome::kDuplicate);
  EXPECT_EQ(inbox.next(), 6u);
  EXPECT_EQ(inbox.held(), 0u);
}

TEST(InOrderInbox, HoldsABoundedNumberBehindAGapAndTakesTheRestFromTheOtherPath) {
  InOrderInbox inbox;
  std::vector<std::uint32_t> got;
  auto take = [&](std::uint64_t seq) {
    return inbox.accept(seq, number(static_cast<std::uint32_t>(seq)),
                        [&](Bytes m) { got.push_back(number_of(m)); });
  };
  // Message 1 is missing on the rails; 2.. arrive there. Only kMaxHeld are kept.
  const std::uint64_t n = InOrderInbox::kMaxHeld + 10;
  for (std::uint64_t s = 2; s <= n + 1; ++s)
    EXPECT_EQ(take(s), s <= InOrderInbox::kMaxHeld + 1 ? InOrderInbox::Outcome::kHeld
                                                       : InOrderInbox::Outcome::kDropped)
        << s;
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(inbox.held(), InOrderInbox::kMaxHeld);
  // The relay brings them all, in order: every one is taken once.
  for (std::uint64_t s = 1; s <= n + 1; ++s)
    (void)take(s);
  ASSERT_EQ(got.size(), n + 1);
  for (std::uint32_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i], i + 1);
  EXPECT_EQ(inbox.held(), 0u);
}

// A TCP proxy for one connection that can hold every byte in both directions (a black hole: the
// connection stays open, nothing passes) and let them through again.
class HoldingProxy {
 public:
  explicit HoldingProxy(std::uint16_t to) : to_(to) {
    listen_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listen_, 1), 0);
    socklen_t len = sizeof a;
    ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~HoldingProxy() {
    stop_ = true;
    thread_.join();
    for (int fd : {listen_, in_, out_})
      if (fd >= 0) ::close(fd);
  }
  std::uint16_t port() const { return port_; }
  void hold(bool on) { hold_ = on; }

 private:
  void run() {
    pollfd p{listen_, POLLIN, 0};
    while (!stop_ && ::poll(&p, 1, 50) <= 0) {
    }
    if (stop_) return;
    in_ = ::accept(listen_, nullptr, nullptr);
    if (in_ < 0) return;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(to_);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    // Rank 0's listener may not be up yet when rank 1 arrives: retried for up to 10 s.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      out_ = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(out_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
      ::close(out_);
      out_ = -1;
      if (stop_ || std::chrono::steady_clock::now() >= until) return;
      std::this_thread::sleep_for(milliseconds(20));
    }
    char buf[65536];
    while (!stop_) {
      if (hold_) {
        std::this_thread::sleep_for(milliseconds(10));
        continue;
      }
      pollfd fds[2] = {{in_, POLLIN, 0}, {out_, POLLIN, 0}};
      if (::poll(fds, 2, 20) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t got = ::recv(fds[i].fd, buf, sizeof buf, 0);
        if (got <= 0) return;
        const int to = i == 0 ? out_ : in_;
        for (ssize_t put = 0; put < got;) {
          const ssize_t n =
              ::send(to, buf + put, static_cast<std::size_t>(got - put), MSG_NOSIGNAL);
          if (n <= 0) return;
          put += n;
        }
      }
    }
  }
  std::uint16_t to_;
  std::uint16_t port_ = 0;
  int listen_ = -1, in_ = -1, out_ = -1;
  std::atomic<bool> stop_{false}, hold_{false};
  std::thread thread_;
};

// The direct path between in-process ranks: a queue and a thread that hands each message to the
// destination's bootstrap (as a world's progress thread does), so that no sender waits.
class DirectWire {
 public:
  explicit DirectWire(std::vector<Bootstrap*> ranks) : ranks_(std::move(ranks)) {
    thread_ = std::thread([this] { run(); });
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      ranks_[r]->set_direct_path([this, r](int to, Bytes m) {
        std::lock_guard lock(mutex_);
        if (queue_.size() >= 4096) return Status(ErrorCode::kNoResource, "direct wire full");
        queue_.push_back({static_cast<int>(r), to, std::move(m)});
        ++sent_;
        cv_.notify_one();
        return Status::ok();
      });
  }
  ~DirectWire() {
    for (auto* b : ranks_)
      b->set_direct_path(nullptr);
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  std::size_t sent() {
    std::lock_guard lock(mutex_);
    return sent_;
  }

 private:
  struct Item {
    int from, to;
    Bytes message;
  };
  void run() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      Item it = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      ranks_[static_cast<std::size_t>(it.to)]->on_direct_message(it.from, it.message);
      lock.lock();
    }
  }
  std::vector<Bootstrap*> ranks_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::size_t sent_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

struct Received {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::uint32_t> numbers;
  void add(const Bytes& m) {
    std::lock_guard lock(mutex);
    numbers.push_back(number_of(m));
    cv.notify_all();
  }
  bool wait_for(std::size_t n, milliseconds limit) {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, limit, [&] { return numbers.size() >= n; });
  }
};

// Both ranks all-gather `round`'s blobs; returns false (with a failure) unless both got them.
void both_allgather(Bootstrap& a, Bootstrap& b, std::uint32_t round) {
  auto fa = std::async(std::launch::async,
                       [&] { return a.allgather(number(100 * round), milliseconds(20000)); });
  auto rb = b.allgather(number(100 * round + 1), milliseconds(20000));
  auto ra = fa.get();
  ASSERT_TRUE(ra.is_ok()) << ra.status().to_string();
  ASSERT_TRUE(rb.is_ok()) << rb.status().to_string();
  for (const auto* r : {&*ra, &*rb}) {
    ASSERT_EQ(r->size(), 2u);
    EXPECT_EQ(number_of((*r)[0]), 100 * round);
    EXPECT_EQ(number_of((*r)[1]), 100 * round + 1);
  }
}

TEST(BootstrapDirectPath, AllGathersBarriersAndMessagesCompleteWhileRankZeroIsSilent) {
  Received at0, at1;  // first: the bootstraps that call into them go before them
  const auto port = test::free_port();
  HoldingProxy proxy(port);
  BootstrapOptions o0{0, 2, HostPort{"127.0.0.1", port}, Token{}, milliseconds(10000), ""};
  BootstrapOptions o1 = o0;
  o1.rank = 1;
  o1.root.port = proxy.port();  // rank 1 reaches rank 0 through the proxy
  auto f0 = std::async(std::launch::async, [&] { return Bootstrap::join(o0, number(0)); });
  auto b1 = Bootstrap::join(o1, number(1));
  auto b0 = f0.get();
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
  ASSERT_TRUE(b1.is_ok()) << b1.status().to_string();
  Bootstrap& r0 = **b0;
  Bootstrap& r1 = **b1;
  r0.set_handlers([&](int, Bytes m) { at0.add(m); }, [](int, const std::string&) {});
  r1.set_handlers([&](int, Bytes m) { at1.add(m); }, [](int, const std::string&) {});
  DirectWire wire({&r0, &r1});

  // Rank 0 answers: everything goes through it; messages also take the direct path.
  both_allgather(r0, r1, 1);
  ASSERT_TRUE(r0.send_to(1, number(1)).is_ok());
  ASSERT_TRUE(at1.wait_for(1, milliseconds(5000)));

  // Rank 1's connection to rank 0 is black-holed: all-gathers, barriers and messages both ways
  // go on the direct path.
  proxy.hold(true);
  const auto black_holed = Clock::now();
  for (std::uint32_t round = 2; round <= 5; ++round) {
    both_allgather(r0, r1, round);
    auto bar = std::async(std::launch::async, [&] { return r0.barrier(milliseconds(20000)); });
    const Status s1 = r1.barrier(milliseconds(20000));
    const Status s0 = bar.get();
    ASSERT_TRUE(s0.is_ok()) << s0.to_string();
    ASSERT_TRUE(s1.is_ok()) << s1.to_string();
  }
  for (std::uint32_t i = 2; i <= 20; ++i) {
    ASSERT_TRUE(r0.send_to(1, number(i)).is_ok());
    ASSERT_TRUE(r1.send_to(0, number(i)).is_ok());
  }
  ASSERT_TRUE(at1.wait_for(20, milliseconds(5000)));
  ASSERT_TRUE(at0.wait_for(19, milliseconds(5000)));
  // Eight all-gathers in all, far below one all-gather's 20 s timeout (a hang bound only).
  EXPECT_LT(Clock::now() - black_holed, std::chrono::seconds(15));

  // Rank 0 is heard again: what it held arrives late (all-gather answers, the relay's copies of
  // the messages) and changes nothing; the next all-gathers complete.
  proxy.hold(false);
  for (std::uint32_t round = 6; round <= 8; ++round)
    both_allgather(r0, r1, round);
  ASSERT_TRUE(r0.send_to(1, number(21)).is_ok());
  ASSERT_TRUE(at1.wait_for(21, milliseconds(5000)));
  std::this_thread::sleep_for(milliseconds(300));  // any late copy would have arrived
  std::vector<std::uint32_t> want1, want0;
  for (std::uint32_t i = 1; i <= 21; ++i)
    want1.push_back(i);
  for (std::uint32_t i = 2; i <= 20; ++i)
    want0.push_back(i);
  {
    std::lock_guard lock(at1.mutex);
    EXPECT_EQ(at1.numbers, want1);
  }
  {
    std::lock_guard lock(at0.mutex);
    EXPECT_EQ(at0.numbers, want0);
  }
  EXPECT_GT(wire.sent(), 40u);  // the all-gathers' blobs went direct, not only the messages
}

}  // namespace
}  // namespace r2ccl
