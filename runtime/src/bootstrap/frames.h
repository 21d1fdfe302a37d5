// The bootstrap's wire format: the frame header and the parsers of every frame payload, as
// functions of bytes alone (the root, the ranks and the fuzz targets call the same code).
// Private to runtime/src/bootstrap.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/crypto.h"
#include "r2ccl/runtime/bootstrap.h"
#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl::bootstrap_wire {

inline constexpr std::uint32_t kMagic = 0x53423252;  // "R2BS"
// 3: relayed control messages carry a sequence number; the direct path (below) exists.
inline constexpr std::uint16_t kVersion = 3;
inline constexpr std::size_t kHeaderSize = 12;
inline constexpr std::uint32_t kMaxFrame = 64u << 20;
inline constexpr int kMaxRanks = 65536;
inline constexpr std::uint32_t kIdMagic = 0x44493252;  // "R2ID", a unique id

enum class FrameType : std::uint16_t {
  kHello = 1,       // rank -> root: version, token, rank, nranks, info
  kWelcome = 2,     // root -> rank: every rank's info
  kError = 3,       // root -> rank: why it was refused or why the job failed
  kColl = 4,        // rank -> root: seq, blob
  kCollResult = 5,  // root -> rank: seq, every rank's blob
  kSend = 6,        // rank -> root: destination rank, message
  kDeliver = 7,     // root -> rank: source rank, message
  kPeerLeft = 8,    // root -> rank: a rank left the control path, and why
  kChallenge = 9,   // root -> rank, first: a nonce the hello must answer
};

// The hello answers the root's challenge with an HMAC of the job's token, which itself never
// crosses the wire; the welcome carries the root's own proof:
//   hello: u32 version | u32 rank | u32 nranks | blob info | client nonce (16) | MAC (32),
//     MAC = HMAC-SHA256(token, "r2ccl bootstrap hello" | challenge | the hello's bytes before it)
//   welcome: MAC (32) = HMAC-SHA256(token, "r2ccl bootstrap welcome" | client nonce |
//     challenge) | u32 n | n x blob
inline constexpr std::string_view kHelloLabel = "r2ccl bootstrap hello";
inline constexpr std::string_view kWelcomeLabel = "r2ccl bootstrap welcome";

using HeaderBytes = std::array<std::byte, kHeaderSize>;
struct Header {
  FrameType type;
  std::uint32_t length;
};
HeaderBytes encode_header(FrameType type, std::size_t len);
// Magic, version and length (at most kMaxFrame) checked; the type is checked by whoever reads
// the frame.
Result<Header> decode_header(const HeaderBytes& h);
Bytes frame(FrameType type, const Bytes& payload);

struct Hello {
  std::uint32_t version = 0;
  int rank = -1;
  int nranks = 0;
  Bytes info;
  crypto::Nonce client{};
  crypto::Mac mac{};
  std::size_t signed_size = 0;  // the payload bytes the MAC covers
};
// The hello's fields; its MAC is checked by the root (it needs the challenge and the token).
Result<Hello> parse_hello(std::span<const std::byte> payload);

struct Coll {
  std::uint64_t seq = 0;
  Bytes blob;
};
Result<Coll> parse_coll(std::span<const std::byte> payload);

// kSend (rank -> root: the destination) and kDeliver (root -> rank: the source) have one
// format: u32 rank | blob message.
struct Relayed {
  std::uint32_t rank = 0;
  Bytes message;
};
Result<Relayed> parse_relayed(std::span<const std::byte> payload);

// The welcome's proof and the n per-rank blobs after it (n must equal `nranks`).
struct Welcome {
  crypto::Mac proof{};
  std::vector<Bytes> info;
};
Result<Welcome> parse_welcome(std::span<const std::byte> payload, int nranks);

// An all-gather result: u64 seq | u32 n | n x blob (n must equal `nranks`).
Result<std::vector<Bytes>> parse_coll_result(std::span<const std::byte> payload, int nranks);
// The sequence number an all-gather result answers (nothing when the payload is too short).
std::optional<std::uint64_t> coll_result_seq(std::span<const std::byte> payload);

struct PeerLeft {
  int rank = 0;
  std::string why;
};
Result<PeerLeft> parse_peer_left(std::span<const std::byte> payload);
// kError: the reason, a string.
Result<std::string> parse_error(std::span<const std::byte> payload);

// The message inside kSend / kDeliver: u64 seq | the message (the rest). seq counts the sender's
// control messages to that destination from 1, so that the receiver takes each once and in order
// whichever path (rank 0's relay or the direct path) brings it first.
struct Sequenced {
  std::uint64_t seq = 0;
  Bytes message;
};
Result<Sequenced> parse_sequenced(std::span<const std::byte> payload);
Bytes encode_sequenced(std::uint64_t seq, std::span<const std::byte> message);

// The direct path: a world's data rails (authenticated by the job's token; the sender is the
// rail's peer, never a field) carry copies of what would go through rank 0:
//   u8 kind | u64 seq | body (the rest)
//   kind 1: this rank's contribution to all-gather #seq
//   kind 2: control message #seq from this rank to the receiver (as in Sequenced)
enum class DirectKind : std::uint8_t { kContribution = 1, kMessage = 2 };
struct Direct {
  DirectKind kind = DirectKind::kContribution;
  std::uint64_t seq = 0;
  Bytes body;
};
Result<Direct> parse_direct(std::span<const std::byte> payload);
Bytes encode_direct(DirectKind kind, std::uint64_t seq, std::span<const std::byte> body);

// A unique id: magic, root host and port, token.
Status decode_id(std::span<const std::byte> id, HostPort* at, Token* token);

}  // namespace r2ccl::bootstrap_wire
