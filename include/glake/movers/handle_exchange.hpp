// Device handles handed from a move out to a move back in the same process: an offload that
// completes gives the handles it would release to a prefetch that wants handles of their sizes,
// so that neither releases nor creates one.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace glake {

// ---------------------------------------------------------------------------------------------
// handle_exchanging
//
// Where a move back (the taker) says which handle sizes it wants, and moves out completing
// meanwhile (the givers) leave their device handles instead of releasing them. A handle is
// given only after the copies out of it have completed and it is mapped nowhere, so a taker's
// copies may write it at once: ordering is by construction, not by events.
//
// | expression      | returns     | throws    | meaning
// |-----------------|-------------|-----------|------------------------------------------------
// | X::handle_type  |             |           | the backend's device handle
// | x.want(n)       | void        | bad_alloc | one more handle of n bytes wanted (room for it is
// |                 |             |           | reserved, so give never allocates)
// | cx.wants(n)     | bool        | no        | a handle of n bytes would be taken now
// | cx.wanted()     | size_t      | no        | handles wanted and not given yet
// | x.give(h, n)    | void        | no        | h (n bytes, wants(n)) kept for take; one want less
// | x.take(n)       | optional<H> | no        | a given handle of n bytes, if any
// | x.served(k)     | void        | no        | k handles taken stay with a move that finished:
// |                 |             |           | counted in handed()
// | cx.bytes()      | size_t      | no        | bytes given and not taken: still the backend's
// | x.close(f)      | void        | no        | no more wants; f(h, n) for each handle not taken
// | cx.handed()     | uint64_t    | no        | handles served since construction
//
// A handle taken counts only once its move finished: a taker that runs out of memory, or whose
// move is undone, releases what it took, and so does close for what nobody took; neither was
// handed over. Between two moves an exchange is closed: empty, wanting nothing, so it holds no
// memory any budget does not see. Model: handle_exchange.
// ---------------------------------------------------------------------------------------------
template <class X>
concept handle_exchanging = requires(X& x, const X& cx, std::size_t n, typename X::handle_type h,
                                     void (*f)(typename X::handle_type, std::size_t)) {
  { x.want(n) } -> std::same_as<void>;
  { cx.wants(n) } noexcept -> std::same_as<bool>;
  { cx.wanted() } noexcept -> std::same_as<std::size_t>;
  { x.give(h, n) } noexcept -> std::same_as<void>;
  { x.take(n) } noexcept -> std::same_as<std::optional<typename X::handle_type>>;
  { x.served(n) } noexcept -> std::same_as<void>;
  { cx.bytes() } noexcept -> std::same_as<std::size_t>;
  { x.close(f) } noexcept -> std::same_as<void>;
  { cx.handed() } noexcept -> std::same_as<std::uint64_t>;
};

/// Wants counted by size in a small map, given handles in a vector reserved by want. want is
/// O(log sizes), give O(log sizes), take O(handles given). Thread safety: none (the mover's
/// owner serialises access). Streams: none of its own; see the concept (given handles have no
/// work pending on them).
template <class Handle>
class handle_exchange {
 public:
  using handle_type = Handle;

  void want(std::size_t bytes) {
    given_.reserve(given_.size() + wanted_count_ + 1);
    ++wanted_[bytes];
    ++wanted_count_;
  }
  bool wants(std::size_t bytes) const noexcept {
    const auto it = wanted_.find(bytes);
    return it != wanted_.end() && it->second != 0;
  }
  std::size_t wanted() const noexcept { return wanted_count_; }
  void give(handle_type handle, std::size_t bytes) noexcept {
    --wanted_.find(bytes)->second;
    --wanted_count_;
    given_.push_back(entry{handle, bytes});  // within the room want reserved
    bytes_ += bytes;
  }
  std::optional<handle_type> take(std::size_t bytes) noexcept {
    for (std::size_t i = given_.size(); i-- > 0;) {
      if (given_[i].size != bytes) continue;
      const handle_type h = given_[i].handle;
      given_[i] = given_.back();
      given_.pop_back();
      bytes_ -= bytes;
      return h;
    }
    return std::nullopt;
  }
  void served(std::size_t handles) noexcept { handed_ += handles; }
  std::size_t bytes() const noexcept { return bytes_; }
  template <class F>
  void close(F&& leftover) noexcept {
    for (const entry& e : given_) leftover(e.handle, e.size);
    given_.clear();
    wanted_.clear();
    wanted_count_ = 0;
    bytes_ = 0;
  }
  std::uint64_t handed() const noexcept { return handed_; }

 private:
  struct entry {
    handle_type handle{};
    std::size_t size = 0;
  };
  std::map<std::size_t, std::size_t> wanted_;  // size -> handles wanted of it
  std::size_t wanted_count_ = 0;
  std::vector<entry> given_;
  std::size_t bytes_ = 0;
  std::uint64_t handed_ = 0;
};
static_assert(handle_exchanging<handle_exchange<int>>);

}  // namespace glake
