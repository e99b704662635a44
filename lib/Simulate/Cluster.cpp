//===- Cluster.cpp - Cluster descriptions: presets and files --------------===//
//
// The file keeps human units: TFLOP/s, GB/s (1e9 bytes/s), GB (1e9
// bytes), microseconds.
//
//===----------------------------------------------------------------------===//

#include "tessel/Simulate/Cluster.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"

#include <cmath>
#include <nlohmann/json.hpp>

using namespace tessel::sim;
using json = nlohmann::json;
using llvm::formatv;

static llvm::Error error(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

double Cluster::peak(const std::string &elementType) const {
  auto it = device.peakFlops.find(elementType);
  if (it != device.peakFlops.end())
    return it->second;
  // A type the device has no figure for runs at its fp32 rate.
  it = device.peakFlops.find("fp32");
  return it != device.peakFlops.end() ? it->second : 0;
}

//===--- Presets ----------------------------------------------------------===//

namespace {
// The figures of one preset device and its node (docs/simulator.md gives
// the sources in full).
struct PresetSpec {
  const char *gpu, *deviceName;
  double memoryGiB, bf16Tflops, fp32Tflops, hbmGBs;
  double nvlinkGBs, nicGBs;
  int64_t nics;
  const char *computeSource, *linkSource;
};

const PresetSpec kPresets[] = {
    {"a100-80g", "NVIDIA A100-SXM4-80GB", 80, 312, 19.5, 2039, 300, 25, 8,
     "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense BF16, 19.5 "
     "TFLOP/s FP32, 2,039 GB/s HBM2e, 80 GB",
     "DGX A100 user guide: NVLink 3 at 600 GB/s per GPU (300 GB/s each "
     "way) through NVSwitch; 8 ConnectX-6 HDR InfiniBand 200 Gb/s NICs "
     "for compute traffic"},
    {"h100", "NVIDIA H100-SXM5-80GB", 80, 989.4, 66.9, 3350, 450, 50, 8,
     "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense BF16, 67 TFLOP/s "
     "FP32, 3.35 TB/s HBM3, 80 GB",
     "DGX H100 user guide: NVLink 4 at 900 GB/s per GPU (450 GB/s each "
     "way) through NVSwitch; 8 ConnectX-7 NDR 400 Gb/s NICs"},
    {"h200", "NVIDIA H200-SXM-141GB", 141, 989.4, 66.9, 4800, 450, 50, 8,
     "NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16, 67 TFLOP/s "
     "FP32, 4.8 TB/s HBM3e, 141 GB",
     "HGX H200: NVLink 4 at 900 GB/s per GPU (450 GB/s each way); 8 "
     "ConnectX-7 NDR 400 Gb/s NICs"},
};

// What a GPU's kernels reach, before `tessel calibrate` measures them on
// one (docs/simulator.md): cuBLAS(Lt) GEMMs at large shapes reach about
// 85% of the dense peak; fused (flash) attention about 55% over forward
// and backward; memory-bound kernels about 80% of the HBM bandwidth;
// NCCL's ring about 80% of a link's bandwidth.
constexpr double kGemmEfficiency = 0.85, kGemmHalfSize = 128;
constexpr double kAttentionEfficiency = 0.55, kMemoryEfficiency = 0.8;
constexpr double kKernelOverheadUs = 4, kLinkEfficiency = 0.8;
constexpr double kNvlinkLatencyUs = 5, kIbLatencyUs = 10, kPcieGBs = 25;
} // namespace

std::vector<std::string> tessel::sim::clusterPresets() {
  std::vector<std::string> names;
  for (const PresetSpec &p : kPresets)
    names.push_back(p.gpu);
  return names;
}

llvm::Expected<Cluster> tessel::sim::presetCluster(const std::string &gpu,
                                                   int64_t gpusPerNode,
                                                   int64_t nodes) {
  const PresetSpec *spec = nullptr;
  for (const PresetSpec &p : kPresets)
    if (gpu == p.gpu)
      spec = &p;
  if (!spec) {
    std::string names;
    for (const std::string &n : clusterPresets())
      names += (names.empty() ? "" : ", ") + n;
    return error(formatv("--gpu: unknown GPU '{0}' (presets: {1})", gpu,
                         names));
  }
  if (gpusPerNode < 1 || gpusPerNode > 8)
    return error(formatv("--gpus-per-node: must be 1..8 (a node of the "
                         "preset holds 8 GPUs), got {0}",
                         gpusPerNode));
  if (nodes < 1)
    return error(formatv("--nodes: must be >= 1, got {0}", nodes));
  Cluster c;
  c.name = formatv("{0} x {1} ({2} per node)", nodes * gpusPerNode, gpu,
                   gpusPerNode);
  Device &d = c.device;
  d.name = spec->deviceName;
  d.memoryBytes = spec->memoryGiB * 1e9;
  d.peakFlops["bf16"] = spec->bf16Tflops * 1e12;
  d.peakFlops["fp32"] = spec->fp32Tflops * 1e12;
  d.peakFlops["fp64"] = spec->fp32Tflops / 2 * 1e12;
  d.memoryBandwidth = spec->hbmGBs * 1e9;
  d.gemmEfficiency = kGemmEfficiency;
  d.gemmHalfSize = kGemmHalfSize;
  d.attentionEfficiency = kAttentionEfficiency;
  d.memoryEfficiency = kMemoryEfficiency;
  d.kernelOverhead = kKernelOverheadUs * 1e-6;
  d.hostBandwidth = kPcieGBs * 1e9;
  c.gpusPerNode = gpusPerNode;
  c.nodes = nodes;
  c.intraNode = {spec->nvlinkGBs * 1e9, kNvlinkLatencyUs * 1e-6,
                 kLinkEfficiency};
  // A node's NICs serve its GPUs; fewer GPUs per node keep one NIC each.
  c.interNode = {spec->nicGBs * 1e9, kIbLatencyUs * 1e-6, kLinkEfficiency};
  c.nicsPerNode = std::min<int64_t>(spec->nics, gpusPerNode);
  c.sources["device"] = spec->computeSource;
  c.sources["links"] = spec->linkSource;
  c.sources["efficiencies"] =
      "defaults for a GPU not yet measured by tessel calibrate "
      "(docs/simulator.md)";
  return c;
}

//===--- Files ------------------------------------------------------------===//

namespace {
// Reads the fields of one object, naming each in errors.
class Reader {
public:
  Reader(const json &j, std::string where) : j(j), where(std::move(where)) {}

  llvm::Error number(const char *key, double &out, double scale, bool required,
                     double min = 0, bool strictlyPositive = false) {
    auto it = j.find(key);
    if (it == j.end()) {
      if (required)
        return error(formatv("{0}.{1}: missing", where, key));
      return llvm::Error::success();
    }
    if (!it->is_number())
      return error(formatv("{0}.{1}: must be a number, got {2}", where, key,
                           it->dump()));
    double v = it->get<double>();
    if (!std::isfinite(v) || v < min || (strictlyPositive && v <= 0))
      return error(formatv("{0}.{1}: must be {2} {3}, got {4}", where, key,
                           strictlyPositive ? ">" : ">=", min, it->dump()));
    out = v * scale;
    return llvm::Error::success();
  }
  llvm::Error integer(const char *key, int64_t &out, bool required) {
    auto it = j.find(key);
    if (it == j.end())
      return required ? error(formatv("{0}.{1}: missing", where, key))
                      : llvm::Error::success();
    if (!it->is_number_integer() || it->get<int64_t>() < 1)
      return error(formatv("{0}.{1}: must be an integer >= 1, got {2}", where,
                           key, it->dump()));
    out = it->get<int64_t>();
    return llvm::Error::success();
  }
  llvm::Error string(const char *key, std::string &out) {
    auto it = j.find(key);
    if (it == j.end())
      return llvm::Error::success();
    if (!it->is_string())
      return error(formatv("{0}.{1}: must be a string, got {2}", where, key,
                           it->dump()));
    out = it->get<std::string>();
    return llvm::Error::success();
  }
  llvm::Error object(const char *key, const json *&out, bool required) {
    auto it = j.find(key);
    out = nullptr;
    if (it == j.end())
      return required ? error(formatv("{0}.{1}: missing", where, key))
                      : llvm::Error::success();
    if (!it->is_object())
      return error(formatv("{0}.{1}: must be an object", where, key));
    out = &*it;
    return llvm::Error::success();
  }
  llvm::Error only(std::initializer_list<const char *> keys) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const char *k : keys)
        known |= it.key() == k;
      if (!known) {
        std::string list;
        for (const char *k : keys)
          list += (list.empty() ? "" : ", ") + std::string(k);
        return error(formatv("{0}.{1}: unknown field (known: {2})", where,
                             it.key(), list));
      }
    }
    return llvm::Error::success();
  }

private:
  const json &j;
  std::string where;
};

llvm::Error readLink(const json &j, const std::string &where, Link &link,
                     int64_t *nics) {
  Reader r(j, where);
  if (nics) {
    if (auto e = r.only({"bandwidth_gbs", "latency_us", "efficiency",
                         "nics_per_node"}))
      return e;
  } else if (auto e = r.only({"bandwidth_gbs", "latency_us", "efficiency"})) {
    return e;
  }
  if (auto e = r.number("bandwidth_gbs", link.bandwidth, 1e9, true, 0, true))
    return e;
  if (auto e = r.number("latency_us", link.latency, 1e-6, true))
    return e;
  if (auto e = r.number("efficiency", link.efficiency, 1, false, 0, true))
    return e;
  if (link.efficiency > 1)
    return error(formatv("{0}.efficiency: must be at most 1, got {1}", where,
                         link.efficiency));
  if (nics)
    if (auto e = r.integer("nics_per_node", *nics, true))
      return e;
  return llvm::Error::success();
}
} // namespace

llvm::Expected<Cluster> tessel::sim::clusterFromJson(const json &j,
                                                     const std::string &what) {
  if (!j.is_object())
    return error(what + ": a cluster description must be a JSON object");
  Cluster c;
  Reader top(j, what);
  // `measurements`: what tessel calibrate measured, kept for the record.
  if (auto e = top.only({"name", "device", "gpus_per_node", "nodes",
                         "intra_node", "inter_node", "sources",
                         "measurements"}))
    return std::move(e);
  if (auto e = top.string("name", c.name))
    return std::move(e);
  if (auto e = top.integer("gpus_per_node", c.gpusPerNode, true))
    return std::move(e);
  if (auto e = top.integer("nodes", c.nodes, false))
    return std::move(e);

  const json *dev;
  if (auto e = top.object("device", dev, true))
    return std::move(e);
  std::string dwhere = what + ": device";
  Reader d(*dev, dwhere);
  if (auto e = d.only({"name", "memory_gb", "peak_tflops",
                       "memory_bandwidth_gbs", "gemm_efficiency",
                       "gemm_half_size", "attention_efficiency",
                       "memory_efficiency", "kernel_overhead_us",
                       "graph_kernel_overhead_us", "host_bandwidth_gbs",
                       "kernel_gbs"}))
    return std::move(e);
  Device &dv = c.device;
  if (auto e = d.string("name", dv.name))
    return std::move(e);
  if (auto e = d.number("memory_gb", dv.memoryBytes, 1e9, true, 0, true))
    return std::move(e);
  if (auto e = d.number("memory_bandwidth_gbs", dv.memoryBandwidth, 1e9, true,
                        0, true))
    return std::move(e);
  if (auto e = d.number("gemm_efficiency", dv.gemmEfficiency, 1, false, 0,
                        true))
    return std::move(e);
  if (auto e = d.number("gemm_half_size", dv.gemmHalfSize, 1, false))
    return std::move(e);
  if (auto e = d.number("attention_efficiency", dv.attentionEfficiency, 1,
                        false, 0, true))
    return std::move(e);
  if (auto e = d.number("memory_efficiency", dv.memoryEfficiency, 1, false, 0,
                        true))
    return std::move(e);
  if (auto e = d.number("kernel_overhead_us", dv.kernelOverhead, 1e-6, false))
    return std::move(e);
  if (dev->contains("graph_kernel_overhead_us"))
    if (auto e = d.number("graph_kernel_overhead_us", dv.graphKernelOverhead,
                          1e-6, false))
      return std::move(e);
  if (auto e = d.number("host_bandwidth_gbs", dv.hostBandwidth, 1e9, false))
    return std::move(e);
  for (const char *f : {"gemm_efficiency", "attention_efficiency",
                        "memory_efficiency"})
    if (dev->contains(f) && (*dev)[f].get<double>() > 1)
      return error(formatv("{0}.{1}: must be at most 1, got {2}", dwhere, f,
                           (*dev)[f].dump()));
  const json *peaks;
  if (auto e = d.object("peak_tflops", peaks, true))
    return std::move(e);
  if (peaks->empty())
    return error(dwhere + ".peak_tflops: give at least one element type");
  for (auto it = peaks->begin(); it != peaks->end(); ++it) {
    if (it.key() != "bf16" && it.key() != "fp32" && it.key() != "fp64")
      return error(formatv("{0}.peak_tflops.{1}: unknown element type "
                           "(known: bf16, fp32, fp64)",
                           dwhere, it.key()));
    if (!it->is_number() || it->get<double>() <= 0)
      return error(formatv("{0}.peak_tflops.{1}: must be a number > 0, got "
                           "{2}",
                           dwhere, it.key(), it->dump()));
    dv.peakFlops[it.key()] = it->get<double>() * 1e12;
  }
  const json *kernels;
  if (auto e = d.object("kernel_gbs", kernels, false))
    return std::move(e);
  if (kernels)
    for (auto it = kernels->begin(); it != kernels->end(); ++it) {
      if (!it->is_number() || it->get<double>() <= 0)
        return error(formatv("{0}.kernel_gbs.{1}: must be a number > 0, got "
                             "{2}",
                             dwhere, it.key(), it->dump()));
      dv.kernelBytesPerSecond[it.key()] = it->get<double>() * 1e9;
    }

  const json *intra, *inter;
  if (auto e = top.object("intra_node", intra, true))
    return std::move(e);
  if (auto e = readLink(*intra, what + ": intra_node", c.intraNode, nullptr))
    return std::move(e);
  if (auto e = top.object("inter_node", inter, c.nodes > 1))
    return std::move(e);
  if (inter) {
    if (auto e =
            readLink(*inter, what + ": inter_node", c.interNode, &c.nicsPerNode))
      return std::move(e);
  } else {
    c.interNode = c.intraNode;
    c.nicsPerNode = c.gpusPerNode;
  }
  const json *sources;
  if (auto e = top.object("sources", sources, false))
    return std::move(e);
  if (sources)
    for (auto it = sources->begin(); it != sources->end(); ++it) {
      if (!it->is_string())
        return error(formatv("{0}: sources.{1}: must be a string", what,
                             it.key()));
      c.sources[it.key()] = it->get<std::string>();
    }
  return c;
}

llvm::Expected<Cluster> tessel::sim::readCluster(const std::string &path) {
  auto buffer = llvm::MemoryBuffer::getFile(path);
  if (!buffer)
    return error(formatv("cannot read cluster file {0}: {1}", path,
                         buffer.getError().message()));
  json j = json::parse((*buffer)->getBuffer().begin(),
                       (*buffer)->getBuffer().end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded())
    return error(path + ": not valid JSON");
  return clusterFromJson(j, path);
}

json tessel::sim::clusterToJson(const Cluster &c) {
  const Device &d = c.device;
  json peaks = json::object();
  for (auto &[type, flops] : d.peakFlops)
    peaks[type] = flops / 1e12;
  json device = {{"name", d.name},
                 {"memory_gb", d.memoryBytes / 1e9},
                 {"peak_tflops", peaks},
                 {"memory_bandwidth_gbs", d.memoryBandwidth / 1e9},
                 {"gemm_efficiency", d.gemmEfficiency},
                 {"gemm_half_size", d.gemmHalfSize},
                 {"attention_efficiency", d.attentionEfficiency},
                 {"memory_efficiency", d.memoryEfficiency},
                 {"kernel_overhead_us", d.kernelOverhead * 1e6}};
  if (d.graphKernelOverhead >= 0)
    device["graph_kernel_overhead_us"] = d.graphKernelOverhead * 1e6;
  if (d.hostBandwidth > 0)
    device["host_bandwidth_gbs"] = d.hostBandwidth / 1e9;
  if (!d.kernelBytesPerSecond.empty()) {
    json k = json::object();
    for (auto &[name, rate] : d.kernelBytesPerSecond)
      k[name] = rate / 1e9;
    device["kernel_gbs"] = k;
  }
  json out = {{"name", c.name},
              {"device", device},
              {"gpus_per_node", c.gpusPerNode},
              {"nodes", c.nodes},
              {"intra_node",
               {{"bandwidth_gbs", c.intraNode.bandwidth / 1e9},
                {"latency_us", c.intraNode.latency * 1e6},
                {"efficiency", c.intraNode.efficiency}}},
              {"inter_node",
               {{"bandwidth_gbs", c.interNode.bandwidth / 1e9},
                {"latency_us", c.interNode.latency * 1e6},
                {"efficiency", c.interNode.efficiency},
                {"nics_per_node", c.nicsPerNode}}}};
  if (!c.sources.empty())
    out["sources"] = c.sources;
  return out;
}
