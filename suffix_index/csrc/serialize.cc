// Serialized form (little-endian):
//   header (32 bytes): magic "RPRSXIDX" | u32 version | u32 flags (0) | u64 payload length |
//                      u64 checksum of the payload
//   payload: u32 max_depth | u32 number of key lengths | u32 key length each | u64 max_bytes |
//            u64 next creation ordinal | u64 number of sequences |
//            per sequence, in arena (write) order: i64 id | u64 creation ordinal | u32 length |
//            u32 flags (bit 0: keeps its tails, i.e. was being extended) | i32 token each
// The trie is rebuilt on load; its canonical form makes the rebuilt index identical in every
// observable way (drafts, counts, newest occurrences, memory_bytes()).
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "index.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "serialization assumes a little-endian host");

namespace reprise {
namespace {

constexpr char kMagic[8] = {'R', 'P', 'R', 'S', 'X', 'I', 'D', 'X'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderSize = 32;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// 64-bit checksum over 8-byte words (xxHash64-style lane mixing).
uint64_t checksum(const char* data, size_t n) {
  const uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full, p3 = 0x165667B19E3779F9ull;
  uint64_t h = p3 ^ (uint64_t)n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h ^= rotl(w * p2, 31) * p1;
    h = rotl(h, 27) * p1 + p3;
  }
  for (; i < n; ++i) {
    h ^= (uint8_t)data[i] * p3;
    h = rotl(h, 11) * p1;
  }
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  h ^= h >> 32;
  return h;
}

template <typename T>
void put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

struct Reader {
  const char* p;
  size_t left;
  template <typename T>
  T get(const char* what) {
    if (left < sizeof(T)) throw std::invalid_argument(std::string("corrupt index bytes: truncated at ") + what);
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    left -= sizeof(T);
    return v;
  }
};

[[noreturn]] void corrupt(const std::string& what) { throw std::invalid_argument("corrupt index bytes: " + what); }

}  // namespace

std::string SuffixIndex::serialize() const {
  std::shared_lock<std::shared_mutex> lock(mutex);
  std::string payload;
  put<uint32_t>(&payload, tree.max_depth());
  put<uint32_t>(&payload, (uint32_t)tree.key_lengths().size());
  for (uint32_t k : tree.key_lengths()) put<uint32_t>(&payload, k);
  put<uint64_t>(&payload, max_bytes);
  put<uint64_t>(&payload, tree.next_created());
  auto seqs = tree.sequences_in_arena_order();
  put<uint64_t>(&payload, seqs.size());
  for (const Sequence* s : seqs) {
    put<int64_t>(&payload, s->id);
    put<uint64_t>(&payload, s->created);
    put<uint32_t>(&payload, s->len);
    put<uint32_t>(&payload, tree.has_tails(*s) ? 1u : 0u);
    payload.append(reinterpret_cast<const char*>(tree.seq_tokens(*s)), (size_t)s->len * sizeof(Tok));
  }
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(&out, kVersion);
  put<uint32_t>(&out, 0);
  put<uint64_t>(&out, payload.size());
  put<uint64_t>(&out, checksum(payload.data(), payload.size()));
  out += payload;
  return out;
}

std::unique_ptr<SuffixIndex> SuffixIndex::deserialize(const char* data, size_t size) {
  if (size < kHeaderSize) corrupt("only " + std::to_string(size) + " bytes, the header alone is 32");
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) corrupt("not a Reprise suffix index (bad magic)");
  Reader h{data + 8, kHeaderSize - 8};
  uint32_t version = h.get<uint32_t>("version");
  if (version != kVersion)
    throw std::invalid_argument("unsupported suffix index format version " + std::to_string(version) + " (this build reads " +
                                std::to_string(kVersion) + ")");
  uint32_t flags = h.get<uint32_t>("flags");
  if (flags != 0) corrupt("unknown header flags " + std::to_string(flags));
  uint64_t payload_len = h.get<uint64_t>("payload length");
  uint64_t sum = h.get<uint64_t>("checksum");
  if (payload_len != size - kHeaderSize)
    corrupt("payload length " + std::to_string(payload_len) + " but " + std::to_string(size - kHeaderSize) + " bytes follow the header");
  const char* payload = data + kHeaderSize;
  if (checksum(payload, payload_len) != sum) corrupt("checksum mismatch");

  Reader r{payload, payload_len};
  uint32_t max_depth = r.get<uint32_t>("max_depth");
  uint32_t nkeys = r.get<uint32_t>("key count");
  if (nkeys > kMaxKeyLengths) corrupt("too many key lengths");
  std::vector<uint32_t> keys;
  for (uint32_t i = 0; i < nkeys; ++i) keys.push_back(r.get<uint32_t>("key length"));
  uint64_t max_bytes = r.get<uint64_t>("max_bytes");
  uint64_t next_created = r.get<uint64_t>("next creation ordinal");
  uint64_t nseq = r.get<uint64_t>("sequence count");
  if (nseq > r.left / 24) corrupt("sequence count " + std::to_string(nseq) + " exceeds the payload");
  std::unique_ptr<SuffixIndex> index;
  try {
    index = std::make_unique<SuffixIndex>(max_depth, max_bytes, keys);
  } catch (const std::invalid_argument& e) {
    corrupt(e.what());
  }
  std::unordered_set<int64_t> ids;
  std::unordered_set<uint64_t> created_seen;
  struct Pending { int64_t id; uint64_t created; };
  std::vector<Pending> order;
  std::vector<int64_t> with_tails;
  for (uint64_t i = 0; i < nseq; ++i) {
    int64_t id = r.get<int64_t>("sequence id");
    uint64_t created = r.get<uint64_t>("creation ordinal");
    uint32_t len = r.get<uint32_t>("sequence length");
    uint32_t sflags = r.get<uint32_t>("sequence flags");
    if (id < 0) corrupt("negative sequence id " + std::to_string(id));
    if (!ids.insert(id).second) corrupt("duplicate sequence id " + std::to_string(id));
    if (created >= next_created || !created_seen.insert(created).second) corrupt("bad creation ordinal");
    if (sflags > 1) corrupt("unknown sequence flags");
    if (len > r.left / sizeof(Tok)) corrupt("sequence " + std::to_string(id) + " runs past the payload");
    std::vector<Tok> tokens(len);
    std::memcpy(tokens.data(), r.p, (size_t)len * sizeof(Tok));
    r.p += (size_t)len * sizeof(Tok);
    r.left -= (size_t)len * sizeof(Tok);
    for (uint32_t j = 0; j < len; ++j)
      if (tokens[j] < 0) corrupt("negative token id " + std::to_string(tokens[j]));
    index->tree.add(id, tokens.data(), len);
    order.push_back({id, created});
    if (sflags & 1) with_tails.push_back(id);
  }
  if (r.left != 0) corrupt(std::to_string(r.left) + " trailing bytes");
  // Creation ordinals are unique, so assigning them one by one never collides once all are placed:
  // move every sequence to an ordinal past the current ones first.
  uint64_t scratch = std::max<uint64_t>(next_created, index->tree.next_created());
  for (size_t i = 0; i < order.size(); ++i) index->tree.set_created(order[i].id, scratch + i);
  for (const Pending& p : order) index->tree.set_created(p.id, p.created);
  index->tree.set_next_created(next_created);
  for (int64_t id : with_tails) index->tree.keep_tails(id);
  return index;
}

}  // namespace reprise
