// A request as the engine keeps it, from its admission to its completion.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "c_api.h"
#include "negotiation.h"

namespace keras_ring {

// The caller's kr_request with its name and shape copied; or a group of them
// (kr_enqueue_and_drive's `group`), which is agreed and scheduled as one name
// and run as its members.
struct Request {
  TensorMeta meta;
  const void* input = nullptr;
  void* output = nullptr;
  int device = KR_DEVICE_CPU;
  int64_t* received_splits = nullptr;  // alltoall, optional
  int32_t process_set = 0;
  void* (*allocate_output)(void* ctx, int ndim, const int64_t* shape) = nullptr;
  void (*done)(void* ctx, kr_status status, const char* message) = nullptr;
  void* ctx = nullptr;
  std::chrono::steady_clock::time_point submitted;  // set only while a timeline records
  // A group: its requests, in submission order (none if every one was
  // refused); the group's own buffers and callbacks are unset, and
  // meta.members is filled in only when the description is sent in full.
  bool group = false;
  std::vector<Request> members;

  // Completes the request, or every member of a group.
  void Complete(kr_status status, const std::string& message) const {
    if (group) {
      for (const Request& m : members) m.Complete(status, message);
      return;
    }
    done(ctx, status, message.c_str());
  }

  // Fills in a group's description of its members, to be sent or cached.
  void DescribeMembers() {
    if (!group || meta.members) return;
    auto described = std::make_shared<std::vector<TensorMeta>>();
    described->reserve(members.size());
    for (const Request& m : members) described->push_back(m.meta);
    meta.members = std::move(described);
  }
};

}  // namespace keras_ring
