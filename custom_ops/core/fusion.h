// Tensor fusion: allreduces that run as one collective. The coordinator
// decides which agreed allreduces travel in one response (Fuse); every rank
// cuts the allreduces of a response into collectives no larger than the
// fusion threshold (PlanAllreduces); a FusionBuffer holds the packed inputs
// of a collective over several tensors, or over a compressed one.
#pragma once

#include <cstddef>
#include <vector>

#include "negotiation.h"
#include "request.h"

namespace keras_ring {

// Packs consecutive-or-later allreduce responses that agree on dtype, op and
// scale factors into fused responses of at most `threshold` bytes (a tensor
// larger than the threshold goes alone). Order of first appearance is kept;
// other responses pass through unchanged. Every rank runs the result in the
// same order, so the choice needs no further agreement.
std::vector<Response> Fuse(std::vector<Response> responses, size_t threshold);

// Orders allreduce requests (a group's members, fused tensors) into as few
// collectives of alike tensors (dtype, op, scale factors, compression) as
// `threshold` allows; returns where each collective's requests end. Every
// rank has the same requests in the same order and the same threshold (rank
// 0's), so every rank plans the same collectives.
std::vector<size_t> PlanAllreduces(std::vector<Request>* requests, size_t threshold);

// The buffer that fused or compressed tensors are reduced in; it grows to
// the largest collective and is kept for the next one.
class FusionBuffer {
 public:
  // Copies the inputs of [begin, end), alike tensors, one after another into
  // the buffer, converted to their wire dtype; returns the buffer.
  char* Pack(const Request* begin, const Request* end);
  // Copies the buffer's elements back into the outputs of [begin, end),
  // converted to their dtype.
  void Unpack(const Request* begin, const Request* end) const;
  // Frees the memory.
  void Release() { std::vector<char>().swap(bytes_); }

 private:
  std::vector<char> bytes_;
};

}  // namespace keras_ring
