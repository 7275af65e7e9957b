// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), compact and dependency
// free: the TCP world authenticates its connections with the job's secret and
// the engine is built on users' machines, where OpenSSL headers may be absent.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace keras_ring {

using Sha256Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t bytes);
  void Update(const std::string& data) { Update(data.data(), data.size()); }
  // The digest of everything passed to Update; the object is spent after.
  Sha256Digest Finish();

 private:
  void Compress(const uint8_t* block);

  uint32_t state_[8];
  uint8_t block_[64];
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

Sha256Digest HmacSha256(const std::string& key, const std::string& message);

// Compares in time independent of where the digests differ, so that a
// client cannot find a valid MAC byte by byte.
bool DigestsEqual(const Sha256Digest& a, const Sha256Digest& b);

}  // namespace keras_ring
