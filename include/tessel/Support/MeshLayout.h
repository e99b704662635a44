//===- MeshLayout.h - Ranks, mesh coordinates and pipeline stages -*- C++
//-*-===//
//
// The one place that knows how ranks are laid out on the device mesh and
// where pipeline stages run. The compiler (sharding, stage splitting,
// plan.json, launch files) and the runtime (communicators, peers, data
// slices) both ask it, so the two can never disagree.
//
// Axes are named: dp (data), tp (tensor), pp (pipeline), cp (context) and
// ep (expert). By default ranks are numbered with tp innermost, then cp, ep,
// dp, and pp outermost, as Megatron-LM does, so that a tensor-parallel group
// is a run of consecutive ranks (one node) and a pipeline stage is a
// contiguous block:
//
//   rank = (((pp * DP + dp) * EP + ep) * CP + cp) * TP + tp
//
// parallel.order places the axes otherwise (MeshShape::order, spelled
// innermost first as Megatron-LM's `order` is: "tp-cp-ep-dp-pp" is the
// default). Consecutive ranks share a node, so the innermost axes' groups
// stay inside one. pp is always outermost: each pipeline coordinate runs
// one program, launched on a contiguous block of ranks.
//
// ZeRO's hybrid sharding (parallel.zero_group = G) splits dp in two: a
// shard group of G consecutive dp coordinates (dp % G, inner) and the
// replicas across such groups (dp / G, outer). They are not axes of their
// own (data parallel is still dp) but two more members of an AxisSet,
// kDpShardBit and kDpReplicaBit, that name those sub-groups of dp.
//
// Header-only and free of MLIR so that generated programs and the runtime
// can include it.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_SUPPORT_MESHLAYOUT_H
#define TESSEL_SUPPORT_MESHLAYOUT_H

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tessel {

enum class MeshAxis : int { DP = 0, TP = 1, PP = 2, CP = 3, EP = 4 };
inline constexpr int kNumMeshAxes = 5;

// Every axis, in the order sizes are listed (dp, tp, pp, cp, ep).
inline constexpr MeshAxis kMeshAxes[kNumMeshAxes] = {
    MeshAxis::DP, MeshAxis::TP, MeshAxis::PP, MeshAxis::CP, MeshAxis::EP};
// The default rank order, outermost first.
inline constexpr MeshAxis kRankOrder[kNumMeshAxes] = {
    MeshAxis::PP, MeshAxis::DP, MeshAxis::EP, MeshAxis::CP, MeshAxis::TP};

constexpr const char *meshAxisName(MeshAxis axis) {
  switch (axis) {
  case MeshAxis::DP:
    return "dp";
  case MeshAxis::TP:
    return "tp";
  case MeshAxis::PP:
    return "pp";
  case MeshAxis::CP:
    return "cp";
  case MeshAxis::EP:
    return "ep";
  }
  return "?";
}

inline std::optional<MeshAxis> parseMeshAxis(std::string_view name) {
  for (MeshAxis axis : kMeshAxes)
    if (name == meshAxisName(axis))
      return axis;
  return std::nullopt;
}

// The sub-groups of dp under hybrid sharding: bits after the axes'.
inline constexpr unsigned kDpShardBit = 1u << kNumMeshAxes;
inline constexpr unsigned kDpReplicaBit = 1u << (kNumMeshAxes + 1);
// Bits an AxisSet may hold: the axes and the two sub-groups of dp.
inline constexpr int kNumAxisBits = kNumMeshAxes + 2;

// A set of mesh axes. Collectives run over one: the group of ranks whose
// coordinates differ only along those axes. `bits()` is the form the
// runtime's collectives take (bit i for axis i, then kDpShardBit and
// kDpReplicaBit).
class AxisSet {
public:
  constexpr AxisSet() = default;
  constexpr AxisSet(MeshAxis axis) : bits_(1u << static_cast<int>(axis)) {}
  static constexpr AxisSet fromBits(unsigned bits) {
    AxisSet set;
    set.bits_ = bits & ((1u << kNumAxisBits) - 1);
    return set;
  }
  // Every axis (not the sub-groups of dp, which dp covers).
  static constexpr AxisSet all() {
    return fromBits((1u << kNumMeshAxes) - 1);
  }
  // dp within a hybrid shard group, and dp across the groups.
  static constexpr AxisSet dpShard() { return fromBits(kDpShardBit); }
  static constexpr AxisSet dpReplica() { return fromBits(kDpReplicaBit); }
  // dp and its sub-groups: what a collective over data parallelism names.
  static constexpr AxisSet dataParallel() {
    return fromBits(AxisSet(MeshAxis::DP).bits() | kDpShardBit | kDpReplicaBit);
  }

  constexpr unsigned bits() const { return bits_; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr bool contains(MeshAxis axis) const {
    return bits_ & AxisSet(axis).bits_;
  }
  constexpr bool intersects(AxisSet other) const { return bits_ & other.bits_; }
  int size() const { return __builtin_popcount(bits_); }
  // The axis when the set has exactly one.
  std::optional<MeshAxis> single() const {
    if (size() != 1)
      return std::nullopt;
    return static_cast<MeshAxis>(__builtin_ctz(bits_));
  }

  constexpr AxisSet operator|(AxisSet o) const {
    return fromBits(bits_ | o.bits_);
  }
  constexpr AxisSet operator&(AxisSet o) const {
    return fromBits(bits_ & o.bits_);
  }
  // The axes of this set that are not in `o`.
  constexpr AxisSet operator-(AxisSet o) const {
    return fromBits(bits_ & ~o.bits_);
  }
  AxisSet &operator|=(AxisSet o) { return *this = *this | o; }
  AxisSet &operator&=(AxisSet o) { return *this = *this & o; }
  AxisSet &operator-=(AxisSet o) { return *this = *this - o; }
  constexpr bool operator==(AxisSet o) const { return bits_ == o.bits_; }
  constexpr bool operator!=(AxisSet o) const { return bits_ != o.bits_; }
  constexpr bool operator<(AxisSet o) const { return bits_ < o.bits_; }

  // "dp,tp", "dp_shard", or "-" for the empty set.
  std::string str() const {
    std::string text;
    for (MeshAxis axis : kMeshAxes)
      if (contains(axis))
        text += (text.empty() ? "" : ",") + std::string(meshAxisName(axis));
    if (bits_ & kDpShardBit)
      text += text.empty() ? "dp_shard" : ",dp_shard";
    if (bits_ & kDpReplicaBit)
      text += text.empty() ? "dp_replica" : ",dp_replica";
    return text.empty() ? "-" : text;
  }

private:
  unsigned bits_ = 0;
};

// Axis sizes. A one-rank program has every size 1.
struct MeshShape {
  int64_t size[kNumMeshAxes] = {1, 1, 1, 1, 1};
  // ZeRO's hybrid shard group along dp (parallel.zero_group): dp ranks
  // d and d' share a shard group when d / G == d' / G. 0: not split.
  int64_t dpShard = 0;
  // Rank order, outermost first (parallel.order): a permutation of the
  // axes with pp first.
  MeshAxis order[kNumMeshAxes] = {kRankOrder[0], kRankOrder[1], kRankOrder[2],
                                  kRankOrder[3], kRankOrder[4]};

  int64_t &operator[](MeshAxis axis) { return size[static_cast<int>(axis)]; }
  int64_t operator[](MeshAxis axis) const {
    return size[static_cast<int>(axis)];
  }
  // Whether dp is split into shard groups (of fewer ranks than dp).
  bool hybrid() const {
    return dpShard > 0 && dpShard < (*this)[MeshAxis::DP];
  }
  // The ranks of a shard group along dp, and how many groups there are.
  int64_t shardGroupSize() const {
    return hybrid() ? dpShard : (*this)[MeshAxis::DP];
  }
  int64_t shardGroups() const {
    return (*this)[MeshAxis::DP] / shardGroupSize();
  }
  // The axes ZeRO shards over: dp, or the shard group under hybrid
  // sharding.
  AxisSet shardAxes() const {
    return hybrid() ? AxisSet::dpShard() : AxisSet(MeshAxis::DP);
  }
  // One spelling per group: dp for both halves of dp, no half with dp;
  // without hybrid sharding the shard group is dp and there are no
  // replicas.
  AxisSet canonical(AxisSet axes) const {
    unsigned halves = kDpShardBit | kDpReplicaBit;
    unsigned bits = axes.bits();
    if (!hybrid() && (bits & kDpShardBit))
      bits |= AxisSet(MeshAxis::DP).bits();
    if (!hybrid() || axes.contains(MeshAxis::DP))
      bits &= ~halves;
    else if ((bits & halves) == halves)
      bits = (bits & ~halves) | AxisSet(MeshAxis::DP).bits();
    return AxisSet::fromBits(bits);
  }
  int64_t groupSize(AxisSet axes) const {
    axes = canonical(axes);
    int64_t g = 1;
    for (MeshAxis axis : kMeshAxes)
      if (axes.contains(axis))
        g *= (*this)[axis];
    if (axes.bits() & kDpShardBit)
      g *= shardGroupSize();
    if (axes.bits() & kDpReplicaBit)
      g *= shardGroups();
    return g;
  }
  int64_t worldSize() const { return groupSize(AxisSet::all()); }
  // The axes with more than one rank: a group over the others is the rank
  // alone, so two sets with the same active axes are the same group.
  AxisSet activeAxes() const {
    AxisSet active;
    for (MeshAxis axis : kMeshAxes)
      if ((*this)[axis] > 1)
        active |= axis;
    if (hybrid()) {
      if (shardGroupSize() > 1)
        active |= AxisSet::dpShard();
      if (shardGroups() > 1)
        active |= AxisSet::dpReplica();
    }
    return active;
  }
  // `axes` restricted to the active ones, in one spelling: equal results
  // mean equal groups.
  AxisSet effective(AxisSet axes) const {
    return canonical(axes) & activeAxes();
  }
  // Whether the ranks are numbered in the default order.
  bool defaultOrder() const {
    for (int i = 0; i < kNumMeshAxes; ++i)
      if (order[i] != kRankOrder[i])
        return false;
    return true;
  }
  // The order as parallel.order spells it, innermost first:
  // "tp-cp-ep-dp-pp".
  std::string orderName() const {
    std::string text;
    for (int i = kNumMeshAxes - 1; i >= 0; --i)
      text += std::string(meshAxisName(order[i])) + (i ? "-" : "");
    return text;
  }
  // Sets the order from its spelling; false (and the order unchanged)
  // unless `name` lists every axis once with pp last.
  bool setOrder(std::string_view name) {
    MeshAxis parsed[kNumMeshAxes];
    unsigned seen = 0;
    for (int i = kNumMeshAxes - 1; i >= 0; --i) {
      size_t dash = name.find('-');
      if ((dash == std::string_view::npos) != (i == 0))
        return false; // too few or too many names
      std::optional<MeshAxis> axis = parseMeshAxis(name.substr(0, dash));
      if (!axis || (seen & AxisSet(*axis).bits()))
        return false;
      seen |= AxisSet(*axis).bits();
      parsed[i] = *axis;
      if (i)
        name.remove_prefix(dash + 1);
    }
    if (parsed[0] != MeshAxis::PP)
      return false;
    for (int k = 0; k < kNumMeshAxes; ++k)
      order[k] = parsed[k];
    return true;
  }
  bool operator==(const MeshShape &o) const {
    for (MeshAxis axis : kMeshAxes)
      if ((*this)[axis] != o[axis])
        return false;
    for (int i = 0; i < kNumMeshAxes; ++i)
      if (order[i] != o.order[i])
        return false;
    return (hybrid() ? dpShard : 0) == (o.hybrid() ? o.dpShard : 0);
  }
  bool operator!=(const MeshShape &o) const { return !(*this == o); }
  // "dp=2 tp=4" (axes of size 1 left out; "1 rank" when all are).
  std::string describe() const {
    std::string text;
    for (MeshAxis axis : kMeshAxes)
      if ((*this)[axis] > 1)
        text += (text.empty() ? "" : " ") + std::string(meshAxisName(axis)) +
                "=" + std::to_string((*this)[axis]);
    if (hybrid())
      text += " zero_group=" + std::to_string(dpShard);
    if (!defaultOrder())
      text += (text.empty() ? "order=" : " order=") + orderName();
    return text.empty() ? "1 rank" : text;
  }
};

struct MeshCoords {
  int64_t coord[kNumMeshAxes] = {0, 0, 0, 0, 0};
  int64_t &operator[](MeshAxis axis) { return coord[static_cast<int>(axis)]; }
  int64_t operator[](MeshAxis axis) const {
    return coord[static_cast<int>(axis)];
  }
};

// Where every rank sits on the mesh, and where pipeline stages run: with
// `virtualStages` model chunks per pipeline rank there are
// pp * virtualStages stages, and stage s runs on pipeline coordinate
// s % pp as that rank's chunk s / pp (Megatron's interleaved layout; with
// one chunk per rank, stage s is pipeline coordinate s).
//
// Ranks that run the same pipeline coordinate run the same program, so a
// plan has one distinct program per pipeline coordinate.
class MeshLayout {
public:
  MeshLayout() = default;
  explicit MeshLayout(MeshShape shape, int64_t virtualStages = 1)
      : shape_(shape), virtualStages_(virtualStages) {}

  const MeshShape &shape() const { return shape_; }
  int64_t size(MeshAxis axis) const { return shape_[axis]; }
  int64_t worldSize() const { return shape_.worldSize(); }

  MeshCoords coordsOf(int64_t rank) const {
    MeshCoords c;
    for (int i = kNumMeshAxes - 1; i >= 0; --i) {
      MeshAxis axis = shape_.order[i];
      c[axis] = rank % shape_[axis];
      rank /= shape_[axis];
    }
    return c;
  }
  int64_t rankOf(const MeshCoords &c) const {
    int64_t rank = 0;
    for (MeshAxis axis : shape_.order)
      rank = rank * shape_[axis] + c[axis];
    return rank;
  }

  // This rank's index in its group over `axes`: the group's ranks ordered
  // by their coordinates, dp slowest, then ep, cp and tp (the default rank
  // order, whatever parallel.order numbers the ranks by). A tensor split
  // over several axes holds its pieces in this order, so that pieces,
  // gathers and data rows are the same at every order.
  int64_t groupRank(int64_t rank, AxisSet axes) const {
    return fold(rank, shape_.effective(axes), /*inGroup=*/true);
  }
  // Equal for exactly the ranks of one group over `axes` (their
  // coordinates along every other axis).
  int64_t groupColor(int64_t rank, AxisSet axes) const {
    return fold(rank, shape_.effective(axes), /*inGroup=*/false);
  }
  // The rank whose coordinate along `axis` is `rank`'s plus `offset`, all
  // others equal; none when that leaves the mesh.
  std::optional<int64_t> peer(int64_t rank, MeshAxis axis,
                              int64_t offset) const {
    MeshCoords c = coordsOf(rank);
    c[axis] += offset;
    if (c[axis] < 0 || c[axis] >= shape_[axis])
      return std::nullopt;
    return rankOf(c);
  }

  //===--- Pipeline stages ------------------------------------------------===//

  int64_t pipelineRanks() const { return shape_[MeshAxis::PP]; }
  int64_t virtualStages() const { return virtualStages_; }
  int64_t numStages() const { return pipelineRanks() * virtualStages_; }
  // The pipeline coordinate stage `stage` runs on, and which of that rank's
  // chunks it is.
  int64_t stageOwner(int64_t stage) const { return stage % pipelineRanks(); }
  int64_t stageChunk(int64_t stage) const { return stage / pipelineRanks(); }
  // The stage a pipeline coordinate runs as its chunk `chunk`.
  int64_t stageOf(int64_t pipelineCoord, int64_t chunk) const {
    return chunk * pipelineRanks() + pipelineCoord;
  }

  // Distinct programs: one per pipeline coordinate. Program p runs on the
  // ranks [p * ranksPerProgram(), (p + 1) * ranksPerProgram()).
  int64_t numPrograms() const { return pipelineRanks(); }
  int64_t ranksPerProgram() const { return worldSize() / numPrograms(); }
  int64_t programOf(int64_t rank) const { return coordsOf(rank)[MeshAxis::PP]; }
  int64_t firstRankOfProgram(int64_t program) const {
    return program * ranksPerProgram();
  }

private:
  // The mixed-radix number of `rank`'s coordinates along the axes of
  // `axes` (inGroup) or along the others, in the default rank order
  // (outermost first); dp counts as its replica then its shard coordinate.
  int64_t fold(int64_t rank, AxisSet axes, bool inGroup) const {
    MeshCoords c = coordsOf(rank);
    int64_t number = 0;
    auto digit = [&](bool member, int64_t size, int64_t value) {
      if (member == inGroup)
        number = number * size + value;
    };
    for (MeshAxis axis : kRankOrder) {
      if (axis != MeshAxis::DP || !shape_.hybrid()) {
        digit(axes.contains(axis), shape_[axis], c[axis]);
        continue;
      }
      bool whole = axes.contains(MeshAxis::DP);
      int64_t g = shape_.dpShard;
      digit(whole || (axes.bits() & kDpReplicaBit), shape_.shardGroups(),
            c[axis] / g);
      digit(whole || (axes.bits() & kDpShardBit), g, c[axis] % g);
    }
    return number;
  }

  MeshShape shape_;
  int64_t virtualStages_ = 1;
};

} // namespace tessel

#endif // TESSEL_SUPPORT_MESHLAYOUT_H
