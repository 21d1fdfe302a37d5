// The channel's own wire protocol (control messages and failover messages) and the constants
// its parts share. Private to runtime/src/channel.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "r2ccl/runtime/wire.h"

namespace r2ccl::channel_protocol {
// Control messages on the rails: u64 sequence number, u8 type, body.
// kCts: the receiver's clear-to-send (its region and length). kAbort: the sender refuses a
// receive (size mismatch). kEager: a small message with its data. kRts: a send that is not eager
// announces its length, for a receiver that expects an eager message (and so sent no
// clear-to-send). kAbortSend: the receiver refuses such a send (size mismatch).
enum class ControlType : std::uint8_t {
  kCts = 1,
  kAbort = 2,
  kUser = 3,
  kEager = 4,
  kRts = 5,
  kAbortSend = 6,
  // A failover message (fence, fence acknowledgement, replay query or answer; FenceType below),
  // with sequence number 0: not ordered with the others, handled when it arrives (each is
  // idempotent), so that it never waits behind a gap that only its own replay can fill.
  kFailover = 7,
  // The peer disconnects: nothing follows it (sent after everything else on the channel).
  kGoodbye = 8,
  // Eager credit returned: u64 bytes of the sender's eager messages that the receiver has
  // consumed (matched to a receive, or discarded) since its last credit message.
  kCredit = 9,
};
// Last byte of a kAbort or kAbortSend whose sender ended the message itself (its region was
// deregistered), rather than refused it.
constexpr std::uint8_t kAbortedFlag = 1;
// A control message's writer: room for its sequence number first (send_control fills it in, so
// the message is built once), then its type; `body` bytes are reserved for what follows.
inline ByteWriter control_writer(ControlType type, std::size_t body = 48) {
  ByteWriter w(9 + body);
  w.u64(0).u8(static_cast<std::uint8_t>(type));
  return w;
}

// Messages up to this size travel eagerly inside a control message (no clear-to-send round trip
// before the data).
// Above it, messages are striped over the rails in chunks: on shaped links a 16 KiB message
// sent whole on one rail already takes longer than the clear-to-send round trip it saves.
inline constexpr std::size_t kEagerMax = 8 * 1024;
// With a single rail there is nothing to stripe over, and the round trip is all that a
// rendezvous would add: up to this size (Open MPI's TCP eager limit) messages go eagerly.
inline constexpr std::size_t kEagerMaxOneRail = 64 * 1024;
// Eager credit: a sender has at most this many bytes of eager messages that the receiver has
// not consumed yet; a message that would go past it takes the request-to-send path instead (it
// completes when its data is confirmed, not when it is queued), so a sender that outruns its
// receiver waits instead of filling the receiver's memory. The receiver returns credit once it
// has consumed kCreditReturn bytes, or at its next tick.
inline constexpr std::size_t kEagerCredit = std::size_t{4} << 20;
inline constexpr std::size_t kCreditReturn = std::size_t{1} << 20;
// Control messages (user messages included) not yet confirmed by the peer, at most: past it a
// user message is refused with "try again" (ErrorCode::kNoResource).
inline constexpr std::size_t kMaxControlUnconfirmed = std::size_t{64} << 20;
// Chunks go round-robin to at most this many of the oldest messages in flight.
inline constexpr std::size_t kServeWindow = 4;

// Two-sided message numbers: an epoch in the high bits, the message's index in its epoch in the
// low kEpochShift bits. Both sides of a pair start an epoch at the same point of their programs
// (Endpoint::set_epoch: a communicator starts one with every collective), so that messages
// posted by one side of an operation that failed, and never by the other, cannot pair with a
// later operation's. An index that outgrows its bits carries into the epoch on both sides alike.
inline constexpr unsigned kEpochShift = 24;
inline constexpr std::uint64_t kMaxEpoch = (std::uint64_t{1} << (63 - kEpochShift)) - 1;
// A peer's messages are kept early (their receive or send not posted here yet) from any epoch
// ahead of this side's: a legal program may run any number of collectives ahead of a busy peer
// (eager sends complete once queued; a peer whose operations fail quickly runs ahead of one that
// waits). What is kept early is bounded by size instead (eager data by the eager credit, the
// announcements and clear-to-sends by Channel::kEarlyWindow and ChunkImm::kSlots entries).
inline constexpr std::uint64_t epoch_of(std::uint64_t seq) {
  return seq >> kEpochShift;
}
inline constexpr std::uint64_t index_of(std::uint64_t seq) {
  return seq & ((std::uint64_t{1} << kEpochShift) - 1);
}
// "#index", or "#epoch.index" from the first epoch on.
inline std::string message_number(std::uint64_t seq) {
  return epoch_of(seq) == 0 ? fmt::format("#{}", seq)
                            : fmt::format("#{}.{}", epoch_of(seq), index_of(seq));
}

inline std::string size_mismatch(std::uint64_t seq, const std::string& sender,
                                 const std::string& receiver, std::uint64_t sent,
                                 std::uint64_t posted) {
  return fmt::format(
      "size mismatch in message {} between {} and {}: the sender sends {} bytes, the "
      "receiver posted {} bytes",
      message_number(seq), sender, receiver, sent, posted);
}
// Failover messages, on a surviving rail of the same peer (kFailover), or on the out-of-band
// control path when no rail is connected; each u8 type, u32 rail, u32 epoch, then:
// kFence / kFenceAck: the reason (a string). The sender of either has fenced its end of the rail.
// kReplayQuery: u64 query id, u32 count, count x (u64 message, u32 chunk index): the chunks of
//   two-sided messages that a fenced rail left unconfirmed, asked about before they are replayed.
// kReplayAnswer: u64 query id, u32 count, count x u8 (1: the chunk is still wanted).
enum class FenceType : std::uint8_t {
  kFence = 1,
  kFenceAck = 2,
  kReplayQuery = 3,
  kReplayAnswer = 4,
  // Sent on a SUSPECT rail itself (not on another path): its arrival, its confirmation, the
  // kernel's acknowledgement of it are signs of life of that rail. Nothing else is done with it.
  kKeepalive = 5,
};
// A query names at most this many chunks (more go in further queries).
inline constexpr std::size_t kQueryChunks = 4096;

inline constexpr std::uint64_t kControlCookieBit = 1ull << 63;
inline constexpr std::uint64_t kFailoverCookieBit = 1ull << 62;  // with kControlCookieBit
// Failover messages up to this size also go on the out-of-band path when a rail took them.
inline constexpr std::size_t kOutOfBandCopyMax = 4096;

inline std::uint32_t chunk_count(std::uint64_t length, std::uint64_t chunk) {
  return static_cast<std::uint32_t>((length + chunk - 1) / chunk);
}

inline std::int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::string ms_text(std::chrono::nanoseconds d) {
  return fmt::format("{:.1f}ms", static_cast<double>(d.count()) / 1e6);
}

}  // namespace r2ccl::channel_protocol

namespace r2ccl {
using namespace channel_protocol;  // NOLINT: the channel's parts share these names
}  // namespace r2ccl
