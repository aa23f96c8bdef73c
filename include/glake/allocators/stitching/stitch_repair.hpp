// Planning the repair or growth of a cached stitched range: which of its handles to replace by
// which free handles, which to append after its end, and the pieces it maps afterwards. Pure
// bookkeeping: no driver call, no allocator state.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "glake/detail/vmm_backend.hpp"

namespace glake::detail {

/// Plans how a cached range that maps handles h0..hk (in order) serves a request of `size`
/// bytes: every handle of its first `size` bytes that is not free in place is replaced by a
/// free handle of the same size that the range does not map; if the range is smaller than
/// `size`, free handles of any size are appended after its end, within its reservation. The
/// k-th replaced handle of a size gets the k-th offered spare of that size (neighbours stay
/// neighbours). Then the new layout is cut into pieces: runs of neighbouring handles of one home
/// segment (and, in the claimed prefix, of one block), split where the prefix ends.
///
/// Use: begin; add_current for each handle of the range in order; expect; offer free handles
/// (skipping those for which is_member holds) until satisfied; finish. A handful of distinct
/// handle sizes is assumed (chunk x 2^k): wanted sizes are kept in a small list.
/// Complexity: O(k log k) for k handles in the range, plus O(1) per offered handle and per
/// distinct size. Scratch vectors are kept, so a warm planner does not allocate.
template <class Segment, class Block, class Handle, class Piece>
class stitch_repair_plan {
 public:
  using slot_type = handle_slot<Handle>;
  using replacement = handle_replacement<Handle>;

  void begin() noexcept {
    layout_.clear();
    members_.clear();
    next_.clear();
    changes_.clear();
    wanted_.clear();
    spares_.clear();
    appends_.clear();
    mapped_ = 0;
  }

  /// The range's next handle `h`, in its home segment: replaced when `replace`, else kept;
  /// `claim` is the free block it lies in when it is kept inside the claimed prefix.
  void add_current(Segment* home, const slot_type& h, Block* claim, bool replace) {
    if (replace) {
      changes_.push_back(replacement{next_.size(), slot_type{{}, 0, h.size}});
      add_wanted(h.size);
      claim = nullptr;
    }
    layout_.push_back(h);
    members_.emplace_back(home, h.offset);
    next_.push_back(next_handle{home, h.offset, h.size, claim});
    mapped_ += h.size;
  }

  /// After the last add_current: the request's size and the range's reservation.
  void expect(std::size_t size, std::size_t reserved) {
    std::sort(members_.begin(), members_.end());
    replaced_ = changes_.size();
    short_by_ = size > mapped_ ? size - mapped_ : 0;
    end_ = mapped_;
    reserved_ = reserved;
  }
  std::size_t replaced() const noexcept { return replaced_; }
  bool needs_handles() const noexcept { return replaced_ > 0 || short_by_ > 0; }

  /// Whether the range maps the handle at `offset` of `home` already.
  bool is_member(const Segment* home, std::size_t offset) const noexcept {
    return std::binary_search(members_.begin(), members_.end(), std::pair<const Segment*, std::size_t>{home, offset});
  }

  /// A free handle the range does not map (with the free block it lies in): taken as a spare for
  /// a replaced handle of its size, else appended while the range is short and it fits.
  void offer(Segment* home, const slot_type& h, Block* block) {
    if (take_wanted(h.size)) {
      spares_.push_back(next_handle{home, h.offset, h.size, block});
    } else if (short_by_ > 0 && end_ + h.size <= reserved_) {
      appends_.push_back(next_handle{home, h.offset, h.size, block});
      short_by_ -= std::min(short_by_, h.size);
      end_ += h.size;
    }
  }
  /// Bytes of replacements still to find, and bytes still to append.
  std::size_t wanted_bytes() const noexcept {
    std::size_t bytes = 0;
    for (const auto& w : wanted_) bytes += w.first * w.second;
    return bytes;
  }
  std::size_t short_bytes() const noexcept { return short_by_; }
  bool satisfied() const noexcept { return wanted_bytes() == 0 && short_by_ == 0; }

  /// Once satisfied: the changes to make (replacements in layout order, then appends, each with
  /// its new slot) and the new pieces, for a claimed prefix of `size` bytes. Returns the bytes
  /// mapped afterwards.
  std::size_t finish(std::size_t size, std::vector<Piece>& pieces) {
    for (const auto& w : wanted_) {
      std::size_t k = 0;
      for (std::size_t c = 0; c < replaced_; ++c) {
        if (changes_[c].slot.size != w.first) continue;
        while (spares_[k].size != w.first) ++k;
        next_[changes_[c].index] = spares_[k++];
      }
    }
    for (const next_handle& h : appends_) {
      changes_.push_back(replacement{next_.size(), {}});
      next_.push_back(h);
    }
    for (auto& c : changes_) {
      const next_handle& h = next_[c.index];
      const auto& m = h.home->mapping;
      c.slot = m.slots[m.first_at_or_after(h.offset)];
    }
    pieces.clear();
    std::size_t at = 0;
    for (std::size_t i = 0; i < next_.size(); at += next_[i].size, ++i) {
      const next_handle& h = next_[i];
      const bool joins = i > 0 && at != size && pieces.back().home == h.home &&
                         pieces.back().offset + pieces.back().size == h.offset && next_[i - 1].block == h.block;
      if (joins) {
        pieces.back().size += h.size;
      } else {
        pieces.push_back(Piece{h.home, h.offset, h.size});
      }
    }
    return at;
  }

  /// What the range maps now, side by side, and the changes (after finish).
  std::span<const slot_type> layout() const noexcept { return layout_; }
  std::span<const replacement> changes() const noexcept { return changes_; }
  std::size_t appended() const noexcept { return changes_.size() - replaced_; }

 private:
  struct next_handle {
    Segment* home;
    std::size_t offset;
    std::size_t size;
    Block* block;  ///< the free block it lies in, when it is to be claimed
  };

  void add_wanted(std::size_t size) {
    for (auto& w : wanted_) {
      if (w.first == size) {
        ++w.second;
        return;
      }
    }
    wanted_.emplace_back(size, 1);
  }
  bool take_wanted(std::size_t size) noexcept {
    for (auto& w : wanted_) {
      if (w.first == size && w.second > 0) {
        --w.second;
        return true;
      }
    }
    return false;
  }

  std::vector<slot_type> layout_;
  std::vector<std::pair<const Segment*, std::size_t>> members_;
  std::vector<next_handle> next_;
  std::vector<replacement> changes_;
  std::vector<std::pair<std::size_t, std::size_t>> wanted_;  // (handle size, count) still to find
  std::vector<next_handle> spares_;                          // replacements, in the order found
  std::vector<next_handle> appends_;                         // mapped after the range's end
  std::size_t mapped_ = 0;
  std::size_t replaced_ = 0;
  std::size_t short_by_ = 0;
  std::size_t end_ = 0;
  std::size_t reserved_ = 0;
};

}  // namespace glake::detail
