//===- Cluster.h - The machines a simulated step runs on --------*- C++ -*-===//
//
// A cluster description: one kind of device (its peak FLOP/s by element
// type, memory and bandwidth, and the efficiencies its kernels reach),
// nodes of `gpusPerNode` devices joined by one link (NVLink / NVSwitch, or
// shared memory for CPU ranks), and nodes joined by NICs. The figures of
// the presets and where they come from are in docs/simulator.md; `tessel
// calibrate` measures a CPU description on the machine it runs on.
//
// Ranks are placed on devices in rank order (MeshLayout.h: parallel.order,
// by default tp innermost, pp outermost), so node n holds ranks
// [n * gpusPerNode, (n + 1) * gpusPerNode).
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_SIMULATE_CLUSTER_H
#define TESSEL_SIMULATE_CLUSTER_H

#include "llvm/Support/Error.h"
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessel::sim {

// A link level: the bandwidth one device gets on it (bytes/s, one
// direction), the latency of one message on it (s), and the fraction of the
// bandwidth collectives reach.
struct Link {
  double bandwidth = 0;
  double latency = 0;
  double efficiency = 1;
};

struct Device {
  std::string name;
  double memoryBytes = 0;
  // Dense matmul FLOP/s by element type ("bf16", "fp32", "fp64").
  std::map<std::string, double> peakFlops;
  double memoryBandwidth = 0; // bytes/s
  // A GEMM of m x n x k reaches peak * gemmEfficiency * m/(m+h) * n/(n+h)
  // * k/(k+h) with h = gemmHalfSize.
  double gemmEfficiency = 1;
  double gemmHalfSize = 0;
  // Fused attention's FLOPs (4 B H T^2 D forward, halved when causal; 2.5x
  // that backward) at this fraction of peak.
  double attentionEfficiency = 1;
  // Memory-bound kernels move their operands at this fraction of the
  // memory bandwidth.
  double memoryEfficiency = 1;
  double kernelOverhead = 0; // s per kernel call
  // s per kernel call inside a CUDA graph (a CUDA program's step from its
  // second on); negative: the same as kernelOverhead.
  double graphKernelOverhead = -1;
  // Measured rates of particular runtime functions (bytes of their operands
  // per second), which replace the memory-bound estimate (`tessel
  // calibrate` fills them in for the CPU's kernels).
  std::map<std::string, double> kernelBytesPerSecond;
  // Host-device transfer rate (offloaded optimizer state), bytes/s.
  double hostBandwidth = 0;
};

struct Cluster {
  std::string name;
  Device device;
  int64_t gpusPerNode = 1;
  int64_t nodes = 1;
  Link intraNode;
  // One NIC's link; a node has nicsPerNode of them, shared by its devices.
  Link interNode;
  int64_t nicsPerNode = 1;
  // Where each figure comes from (free text per field, kept in the file).
  std::map<std::string, std::string> sources;

  int64_t devices() const { return gpusPerNode * nodes; }
  int64_t nodeOf(int64_t rank) const { return rank / gpusPerNode; }
  double peak(const std::string &elementType) const;
};

// The presets: a100-80g (DGX A100), h100 (DGX H100), h200 (HGX H200).
std::vector<std::string> clusterPresets();
llvm::Expected<Cluster> presetCluster(const std::string &gpu,
                                      int64_t gpusPerNode, int64_t nodes);

// Reads and checks a cluster file; an error names the file and the field.
llvm::Expected<Cluster> readCluster(const std::string &path);
llvm::Expected<Cluster> clusterFromJson(const nlohmann::json &j,
                                        const std::string &what);
nlohmann::json clusterToJson(const Cluster &c);

} // namespace tessel::sim

#endif // TESSEL_SIMULATE_CLUSTER_H
