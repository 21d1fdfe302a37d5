// The progress engine: who runs the loop (a waiting caller, else the engine's thread), one
// thread at a time, and the idle work.
#include "r2ccl/runtime/provider/progress.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace r2ccl {
namespace {

using namespace std::chrono_literals;
using Clock = ProgressEngine::Clock;

// Bounded wait for a condition another thread makes true.
template <typename F>
bool eventually(F&& f, std::chrono::milliseconds limit = 5000ms) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(200us);
  }
  return f();
}

TEST(Progress, EngineThreadRunsPostedWorkWhenNobodyDrives) {
  ProgressEngine e;
  std::atomic<bool> ran{false};
  std::atomic<bool> in_loop{false};
  e.post([&] {
    in_loop = e.in_loop();
    ran = true;
  });
  ASSERT_TRUE(eventually([&] { return ran.load(); }));
  EXPECT_TRUE(in_loop.load());
  EXPECT_FALSE(e.in_loop());  // this thread is not in the loop
}

TEST(Progress, WaitingCallerRunsTheHandlersItself) {
  ProgressEngine e;
  const auto me = std::this_thread::get_id();
  std::thread::id ran_on;
  bool done = false;
  bool posted = false;
  // Posted while this thread holds the loop, so that no other thread can run it.
  ASSERT_TRUE(e.drive_until(
      [&] {
        if (!posted) {
          posted = true;
          e.post([&] {
            ran_on = std::this_thread::get_id();
            done = true;
          });
        }
        return done;
      },
      Clock::now() + 5s));
  EXPECT_TRUE(done);
  EXPECT_EQ(ran_on, me);
  EXPECT_FALSE(e.in_loop());  // driving ended
}

TEST(Progress, DriverServesTimersAndStopsAtItsDeadline) {
  ProgressEngine e;
  boost::asio::steady_timer t(e.io());
  bool fired = false;
  e.call([&] {
    t.expires_after(5ms);
    t.async_wait([&](const boost::system::error_code& ec) { fired = !ec; });
  });
  ASSERT_TRUE(e.drive_until([&] { return fired; }, Clock::now() + 5s));
  EXPECT_TRUE(fired);
  // Nothing to wait for: returns at the deadline, not before and not much after.
  const auto t0 = Clock::now();
  ASSERT_TRUE(e.drive_until([] { return false; }, t0 + 20ms));
  EXPECT_GE(Clock::now() - t0, 20ms);
  EXPECT_LT(Clock::now() - t0, 2s);
}

TEST(Progress, CallRunsInlineInsideTheLoopAndFromOutside) {
  ProgressEngine e;
  EXPECT_EQ(e.call([] { return 7; }), 7);
  bool nested = false;
  bool done = false;
  e.post([&] {
    nested = e.call([&] { return e.in_loop(); });  // inline: no deadlock
    done = true;
  });
  ASSERT_TRUE(e.drive_until([&] { return done; }, Clock::now() + 5s));
  EXPECT_TRUE(nested);
  // A handler that waits cannot drive the loop it is running in.
  bool refused = false;
  done = false;
  e.post([&] {
    refused = !e.drive_until([] { return true; }, Clock::now() + 1s);
    done = true;
  });
  ASSERT_TRUE(e.drive_until([&] { return done; }, Clock::now() + 5s));
  EXPECT_TRUE(refused);
}

TEST(Progress, CallAfterOrDuringStopRunsOnTheCallerInsteadOfHanging) {
  ProgressEngine e;
  std::atomic<int> ran{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t)
    callers.emplace_back([&] {
      while (!go.load())
        std::this_thread::yield();
      for (int i = 0; i < 200; ++i)
        if (e.call([&] { return e.in_loop(); })) ran.fetch_add(1);
    });
  go.store(true);
  std::this_thread::sleep_for(2ms);
  e.stop();
  for (auto& t : callers)
    t.join();
  EXPECT_EQ(ran.load(), 800);  // every call ran once, as if on the loop
  EXPECT_EQ(e.call([] { return 7; }), 7);
}

TEST(Progress, OneThreadRunsTheLoopAtATimeAmongManyWaiters) {
  ProgressEngine e;
  constexpr int kThreads = 4;
  constexpr int kRounds = 300;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        std::atomic<bool> done{false};
        e.post([&] {
          if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
          std::this_thread::yield();
          inside.fetch_sub(1);
          done = true;
        });
        // Drive when possible, else wait for whoever drives (as Fabric::wait does).
        const auto end = Clock::now() + 10s;
        while (!done && Clock::now() < end)
          if (!e.drive_until([&] { return done.load(); }, Clock::now() + 10ms))
            std::this_thread::sleep_for(50us);
        if (done) finished.fetch_add(1);
      }
    });
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(finished.load(), kThreads * kRounds);
  EXPECT_EQ(overlaps.load(), 0);
}

TEST(Progress, IdleWorkRunsOnceAfterTheBurstOfHandlers) {
  ProgressEngine e;
  std::vector<int> order;
  bool done = false;
  e.post([&] {
    e.when_idle([&] {
      order.push_back(3);
      done = true;
    });
    order.push_back(1);
  });
  e.post([&] { order.push_back(2); });
  ASSERT_TRUE(e.drive_until([&] { return done; }, Clock::now() + 5s));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST(Progress, EngineThreadTakesOverAfterTheCallerStopsDriving) {
  ProgressEngine e;
  bool first = false;
  e.post([&] { first = true; });
  ASSERT_TRUE(e.drive_until([&] { return first; }, Clock::now() + 5s));
  // No caller drives any more: the engine's thread runs what comes next (after its linger).
  std::atomic<bool> later{false};
  std::atomic<bool> on_engine_thread{false};
  const auto me = std::this_thread::get_id();
  e.post([&] {
    on_engine_thread = std::this_thread::get_id() != me;
    later = true;
  });
  ASSERT_TRUE(eventually([&] { return later.load(); }));
  EXPECT_TRUE(on_engine_thread.load());
}

TEST(Progress, SubmitRunsAtOnceOnTheCallerWhenTheLoopIsFree) {
  ProgressEngine e;
  // Let the engine's thread settle into its park (nobody has driven yet, so it may hold the loop
  // for a moment at start).
  bool warm = false;
  e.post([&] { warm = true; });
  ASSERT_TRUE(e.drive_until([&] { return warm; }, Clock::now() + 5s));
  bool ran = false;
  bool in_loop = false;
  std::thread::id on;
  e.submit([&] {
    ran = true;
    in_loop = e.in_loop();
    on = std::this_thread::get_id();
  });
  ASSERT_TRUE(ran);  // before submit returned
  EXPECT_TRUE(in_loop);
  EXPECT_EQ(on, std::this_thread::get_id());
  EXPECT_FALSE(e.in_loop());  // and the caller left the loop again
}

TEST(Progress, SubmittedWorkNeverOvertakesWorkSubmittedEarlier) {
  ProgressEngine e;
  // Another thread holds the loop without running handlers (its done() blocks, and is called
  // with the loop held): the first submission has to queue, and is still queued when the holder
  // lets go of the loop.
  std::atomic<bool> holding{false};
  std::atomic<bool> release{false};
  std::thread holder([&] {
    e.drive_until(
        [&] {
          holding = true;
          const auto end = Clock::now() + 10s;
          while (!release.load() && Clock::now() < end)
            std::this_thread::sleep_for(100us);
          return true;
        },
        Clock::now() + 10s);
  });
  ASSERT_TRUE(eventually([&] { return holding.load(); }));
  std::vector<int> order;
  std::mutex m;
  auto record = [&](int i) {
    std::lock_guard lock(m);
    order.push_back(i);
  };
  e.submit([&] { record(1); });  // the loop is held: queued
  release = true;
  holder.join();
  // The loop is free now, but the first submission may not have run yet: the second must not run
  // before it, inline or not.
  e.submit([&] { record(2); });
  for (int i = 3; i <= 50; ++i)
    e.submit([&, i] { record(i); });
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(m);
    return order.size() == 50;
  }));
  for (int i = 0; i < 50; ++i)
    EXPECT_EQ(order[static_cast<std::size_t>(i)], i + 1);
}

}  // namespace
}  // namespace r2ccl
