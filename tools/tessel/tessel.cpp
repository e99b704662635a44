//===- tessel.cpp - The tessel command line -------------------------------===//
//
//   tessel compile SPEC -o DIR [layout flags] [--set key=value]... [--dump-ir]
//   tessel run DIR [--steps N] [--data FILE] ...
//   tessel generate DIR --weights PATH --prompt TEXT ...
//   tessel inspect DIR --ir STAGE
//   tessel data (encode|synth) ...
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Simulate.h"
#include "Compile.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

using namespace llvm;

// The layout flags common to compile and check, as typed values: a flag
// not given leaves the spec's field alone.
static const char kFuseKernelsHelp[] =
    "Join kernels that run back to back into one call (a matmul and its "
    "bias, GELU or their gradients; a residual add and the norm after it): "
    "on by default for cuda, off for cpu";

static tessel::LayoutOverrides
layoutFromFlags(const cl::opt<int> &dp, const cl::opt<int> &tp,
                const cl::opt<int> &pp, const cl::opt<int> &microbatches,
                const cl::opt<int> &virtualStages,
                const cl::opt<std::string> &schedule, const cl::opt<bool> &sp,
                const cl::opt<int> &ep, const cl::opt<int> &cp,
                const cl::opt<std::string> &order) {
  tessel::LayoutOverrides layout;
  auto count = [](const cl::opt<int> &flag) -> std::optional<int64_t> {
    if (!flag.getNumOccurrences())
      return std::nullopt;
    return (int64_t)flag;
  };
  layout.dp = count(dp);
  layout.tp = count(tp);
  layout.pp = count(pp);
  layout.ep = count(ep);
  layout.cp = count(cp);
  layout.microbatches = count(microbatches);
  layout.virtualStages = count(virtualStages);
  if (schedule.getNumOccurrences())
    layout.schedule = schedule;
  if (sp.getNumOccurrences())
    layout.sequenceParallel = (bool)sp;
  if (order.getNumOccurrences())
    layout.order = order;
  return layout;
}

// --set, --recompute, --zero, --zero-group and --offload as spec
// overrides, in that order.
static std::vector<std::string>
specOverrides(const cl::list<std::string> &sets,
              const cl::opt<std::string> &recompute, const cl::opt<int> &zero,
              const cl::opt<int> &zeroGroup,
              const cl::opt<std::string> &offload) {
  std::vector<std::string> overrides(sets.begin(), sets.end());
  if (recompute.getNumOccurrences())
    overrides.push_back("train.recompute=\"" + recompute + "\"");
  if (zero.getNumOccurrences())
    overrides.push_back("parallel.zero=" + std::to_string(zero));
  if (zeroGroup.getNumOccurrences())
    overrides.push_back("parallel.zero_group=" + std::to_string(zeroGroup));
  if (offload.getNumOccurrences())
    overrides.push_back("parallel.offload=\"" + offload + "\"");
  return overrides;
}

// An option the command does not have: one message naming the closest
// that it has (LLVM's parser would go on to take the option's value for a
// positional argument and report that too). Call after
// HideUnrelatedOptions.
static bool unknownOption(int argc, char **argv) {
  auto options = cl::getRegisteredOptions();
  for (int i = 1; i < argc; ++i) {
    StringRef arg = argv[i];
    if (arg == "--")
      return false;
    if (!arg.starts_with("-") || arg.size() < 2 ||
        (arg[1] >= '0' && arg[1] <= '9') || arg[1] == '.')
      continue; // a value or a negative number
    StringRef name = arg.ltrim('-').split('=').first;
    if (name.empty() || options.count(name))
      continue;
    StringRef best;
    unsigned bestDistance = std::max<unsigned>(2, name.size() / 3) + 1;
    for (auto &[key, option] : options) {
      if (option->getOptionHiddenFlag() != cl::NotHidden)
        continue;
      unsigned d = name.edit_distance(key);
      if (d < bestDistance) {
        bestDistance = d;
        best = key;
      }
    }
    errs() << argv[0] << ": unknown option '" << arg << "'";
    if (!best.empty())
      errs() << "; did you mean '" << (best.size() > 1 ? "--" : "-") << best
             << "'?";
    errs() << " (see --help)\n";
    return true;
  }
  return false;
}

static int compileCommand(int argc, char **argv) {
  cl::OptionCategory category("tessel compile options");
  cl::opt<std::string> input(cl::Positional, cl::Required,
                             cl::desc("<spec.json | program.mlir>"),
                             cl::cat(category));
  cl::opt<std::string> output("o", cl::Required, cl::desc("Output directory"),
                              cl::value_desc("DIR"), cl::cat(category));
  cl::opt<int> dp("dp", cl::desc("Data-parallel degree (parallel.dp)"),
                  cl::init(0), cl::cat(category));
  cl::opt<int> tp("tp", cl::desc("Tensor-parallel degree (parallel.tp)"),
                  cl::init(0), cl::cat(category));
  cl::opt<int> pp("pp", cl::desc("Pipeline stages (parallel.pp)"), cl::init(0),
                  cl::cat(category));
  cl::opt<int> ep("ep",
                  cl::desc("Expert-parallel degree of a mixture-of-experts "
                           "model (parallel.ep)"),
                  cl::init(0), cl::cat(category));
  cl::opt<int> cp("cp",
                  cl::desc("Context-parallel degree: the sequence split "
                           "over cp ranks (parallel.cp)"),
                  cl::init(0), cl::cat(category));
  cl::opt<std::string> order(
      "order",
      cl::desc("Rank order, innermost axis first, e.g. tp-cp-ep-dp-pp (the "
               "default): the inner axes' groups share a node "
               "(parallel.order)"),
      cl::cat(category));
  cl::opt<int> microbatches("microbatches",
                            cl::desc("Microbatches (parallel.microbatches)"),
                            cl::init(0), cl::cat(category));
  cl::opt<std::string> schedule("schedule",
                                cl::desc("Pipeline schedule: gpipe, 1f1b, "
                                         "interleaved (parallel.schedule)"),
                                cl::cat(category));
  cl::opt<bool> sp("sp", cl::desc("Sequence parallelism"), cl::cat(category));
  cl::opt<int> virtualStages("virtual-stages",
                             cl::desc("Pipeline stages per rank "
                                      "(parallel.virtual_stages)"),
                             cl::init(0), cl::cat(category));
  cl::opt<std::string> target("target", cl::desc("cpu or cuda"),
                              cl::init("cpu"), cl::cat(category));
  cl::opt<std::string> cudaArch(
      "cuda-arch",
      cl::desc("GPU architecture for --target cuda (default sm_90: H100/H200)"),
      cl::init("sm_90"), cl::cat(category));
  cl::opt<bool> fuseKernels(
      "fuse-kernels",
      cl::desc(kFuseKernelsHelp),
      cl::cat(category));
  cl::opt<bool> emitOnly(
      "emit-only",
      cl::desc("Write the sources, IR and plan but build no binaries (e.g. "
               "CUDA sources on a machine without nvcc)"),
      cl::cat(category));
  cl::opt<bool> inference(
      "inference",
      cl::desc("Compile the model's inference program (a forward step over a "
               "KV cache, for tessel generate) instead of training; tp only"),
      cl::cat(category));
  cl::opt<int64_t> prefillChunk(
      "prefill-chunk",
      cl::desc("With --inference: prompt tokens per prefill step (default 64 "
               "or model.seq_len; 1: token by token)"),
      cl::init(0), cl::cat(category));
  cl::opt<std::string> recompute(
      "recompute",
      cl::desc("Activation recomputation: none, selective or full "
               "(train.recompute)"),
      cl::cat(category));
  cl::opt<int> zero("zero",
                    cl::desc("ZeRO level over dp (parallel.zero): 1 shards "
                             "AdamW's moments, 2 the gradients too, 3 the "
                             "parameters too"),
                    cl::init(0), cl::cat(category));
  cl::opt<int> zeroGroup(
      "zero-group",
      cl::desc("Hybrid sharding (parallel.zero_group): shard ZeRO's state "
               "over groups of this many dp ranks, replicate across groups"),
      cl::init(0), cl::cat(category));
  cl::opt<std::string> offload(
      "offload",
      cl::desc("none, or optimizer: AdamW's moments in pinned host memory "
               "(parallel.offload; CUDA target)"),
      cl::cat(category));
  cl::list<std::string> sets("set", cl::desc("Override a spec field"),
                             cl::value_desc("key=value"), cl::cat(category));
  cl::opt<bool> dumpIR("dump-ir", cl::desc("Print the IR of every stage"),
                       cl::cat(category));
  cl::opt<std::string> memoryLimit(
      "memory-limit",
      cl::desc("Refuse a plan whose rank holds more than this (e.g. 80GB), "
               "saying what would fit"),
      cl::cat(category));
  cl::opt<std::string> gpu(
      "gpu",
      cl::desc("The memory limit of one GPU: a100-80g, h100 or h200 (the "
               "memory nvidia-smi reports)"),
      cl::cat(category));
  cl::opt<bool> verbose("v", cl::desc("Show compiler commands"),
                        cl::cat(category));
  cl::HideUnrelatedOptions(category);
  if (unknownOption(argc, argv))
    return 2;
  if (!cl::ParseCommandLineOptions(argc, argv, "tessel compile\n", &errs()))
    return 2;

  tessel::CompileOptions options;
  options.input = input;
  options.output = output;
  options.target = target;
  options.cudaArch = cudaArch;
  if (fuseKernels.getNumOccurrences())
    options.fuseKernels = bool(fuseKernels);
  options.emitOnly = emitOnly;
  options.inference = inference;
  options.prefillChunk = prefillChunk;
  if (prefillChunk.getNumOccurrences() && !inference) {
    errs() << "tessel: error: --prefill-chunk applies to --inference only\n";
    return 1;
  }
  options.dumpIR = dumpIR;
  options.verbose = verbose;
  if (memoryLimit.getNumOccurrences()) {
    Expected<int64_t> bytes = tessel::parseBytes(memoryLimit);
    if (!bytes) {
      errs() << "tessel: error: " << toString(bytes.takeError()) << "\n";
      return 1;
    }
    options.memoryLimit = *bytes;
  }
  if (gpu.getNumOccurrences()) {
    // nvidia-smi's total memory of each (MiB).
    static const std::pair<const char *, int64_t> kGpus[] = {
        {"a100-80g", 81920}, {"h100", 81559}, {"h200", 143771}};
    auto it = llvm::find_if(kGpus, [&](auto &g) { return gpu == g.first; });
    if (it == std::end(kGpus)) {
      errs() << "tessel: error: --gpu " << gpu
             << ": expected a100-80g, h100 or h200\n";
      return 1;
    }
    if (memoryLimit.getNumOccurrences()) {
      errs() << "tessel: error: give --gpu or --memory-limit, not both\n";
      return 1;
    }
    options.memoryLimit = it->second << 20;
    options.memoryLimitFrom = "--gpu " + gpu;
  }
  options.overrides = specOverrides(sets, recompute, zero, zeroGroup, offload);
  options.layout =
      layoutFromFlags(dp, tp, pp, microbatches, virtualStages, schedule, sp,
                      ep, cp, order);
  if (Error err = tessel::compile(options)) {
    errs() << "tessel: error: " << toString(std::move(err)) << "\n";
    return 1;
  }
  outs() << "compiled " << input << " -> " << output << "\n";
  tessel::summarizePlan(output, options.emitOnly);
  return 0;
}

static int checkCommandLine(int argc, char **argv) {
  cl::OptionCategory category("tessel check options");
  cl::opt<std::string> input(cl::Positional, cl::Required,
                             cl::desc("<spec.json>"), cl::cat(category));
  cl::opt<int> dp("dp", cl::desc("Data-parallel degree"), cl::init(0),
                  cl::cat(category));
  cl::opt<int> tp("tp", cl::desc("Tensor-parallel degree"), cl::init(0),
                  cl::cat(category));
  cl::opt<int> pp("pp", cl::desc("Pipeline stages"), cl::init(0),
                  cl::cat(category));
  cl::opt<int> ep("ep", cl::desc("Expert-parallel degree"), cl::init(0),
                  cl::cat(category));
  cl::opt<int> cp("cp", cl::desc("Context-parallel degree"), cl::init(0),
                  cl::cat(category));
  cl::opt<std::string> order("order",
                             cl::desc("Rank order, innermost axis first "
                                      "(parallel.order)"),
                             cl::cat(category));
  cl::opt<int> microbatches("microbatches", cl::desc("Microbatches"),
                            cl::init(0), cl::cat(category));
  cl::opt<bool> sp("sp", cl::desc("Sequence parallelism"), cl::cat(category));
  cl::opt<std::string> schedule("schedule",
                                cl::desc("Pipeline schedule: gpipe, 1f1b, "
                                         "interleaved"),
                                cl::cat(category));
  cl::opt<int> virtualStages("virtual-stages",
                             cl::desc("Pipeline stages per rank (interleaved)"),
                             cl::init(0), cl::cat(category));
  cl::opt<int> layers("layers", cl::desc("Shrink the model to N layers"),
                      cl::init(0), cl::cat(category));
  cl::opt<int> steps("steps", cl::desc("Steps to train (default 20)"),
                     cl::init(20), cl::cat(category));
  cl::opt<double> tolerance(
      "tolerance",
      cl::desc("Largest relative difference allowed (default 1e-5; with "
               "--target cuda 1e-4 in fp32, 3e-2 in bf16)"),
      cl::init(-1), cl::cat(category));
  cl::opt<std::string> target(
      "target",
      cl::desc("Backend of the layout: cpu, or cuda (compared with the CPU "
               "one-rank program; needs a GPU per rank)"),
      cl::init("cpu"), cl::cat(category));
  cl::opt<std::string> cudaArch("cuda-arch",
                                cl::desc("GPU architecture for --target cuda"),
                                cl::init("sm_90"), cl::cat(category));
  cl::opt<bool> fuseKernels(
      "fuse-kernels",
      cl::desc(kFuseKernelsHelp),
      cl::cat(category));

  cl::opt<std::string> recompute(
      "recompute",
      cl::desc("Activation recomputation: none, selective or full "
               "(train.recompute)"),
      cl::cat(category));
  cl::opt<int> zero("zero",
                    cl::desc("ZeRO level over dp (parallel.zero): 1 shards "
                             "AdamW's moments, 2 the gradients too, 3 the "
                             "parameters too"),
                    cl::init(0), cl::cat(category));
  cl::opt<int> zeroGroup(
      "zero-group",
      cl::desc("Hybrid sharding (parallel.zero_group): shard ZeRO's state "
               "over groups of this many dp ranks, replicate across groups"),
      cl::init(0), cl::cat(category));
  cl::opt<std::string> offload(
      "offload",
      cl::desc("none, or optimizer: AdamW's moments in pinned host memory "
               "(parallel.offload; CUDA target)"),
      cl::cat(category));
  cl::list<std::string> sets("set", cl::desc("Override a spec field"),
                             cl::value_desc("key=value"), cl::cat(category));
  cl::HideUnrelatedOptions(category);
  if (unknownOption(argc, argv))
    return 2;
  if (!cl::ParseCommandLineOptions(
          argc, argv,
          "tessel check: trains a layout and the one-rank program and "
          "compares losses and parameters\n",
          &errs()))
    return 2;
  tessel::CheckOptions options;
  options.input = input;
  options.overrides = specOverrides(sets, recompute, zero, zeroGroup, offload);
  if (layers.getNumOccurrences())
    options.layers = layers;
  options.steps = steps;
  options.target = target;
  options.cudaArch = cudaArch;
  if (fuseKernels.getNumOccurrences())
    options.fuseKernels = bool(fuseKernels);
  options.tolerance = tolerance;
  options.layout =
      layoutFromFlags(dp, tp, pp, microbatches, virtualStages, schedule, sp,
                      ep, cp, order);
  return tessel::checkCommand(options);
}

static int gradcheckCommand(int argc, char **argv) {
  cl::OptionCategory category("tessel gradcheck options");
  cl::opt<std::string> input(cl::Positional, cl::Required,
                             cl::desc("<spec.json | program.mlir>"),
                             cl::cat(category));
  cl::opt<std::string> recompute(
      "recompute",
      cl::desc("Activation recomputation: none, selective or full "
               "(train.recompute)"),
      cl::cat(category));
  cl::list<std::string> sets("set", cl::desc("Override a spec field"),
                             cl::value_desc("key=value"), cl::cat(category));
  cl::opt<bool> verbose("v", cl::desc("Show compiler commands"),
                        cl::cat(category));
  cl::HideUnrelatedOptions(category);
  if (unknownOption(argc, argv))
    return 2;
  if (!cl::ParseCommandLineOptions(
          argc, argv,
          "tessel gradcheck: compares every parameter's gradient with central "
          "finite differences in float64\n",
          &errs()))
    return 2;
  tessel::CompileOptions options;
  options.input = input;
  options.verbose = verbose;
  options.overrides.assign(sets.begin(), sets.end());
  if (recompute.getNumOccurrences())
    options.overrides.push_back("train.recompute=\"" + recompute + "\"");
  if (Error err = tessel::gradientCheck(options)) {
    errs() << "tessel: error: " << toString(std::move(err)) << "\n";
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  const char *usage =
      "usage: tessel <command> ...\n"
      "  compile SPEC -o DIR   compile a spec (.json) or graph program "
      "(.mlir)\n"
      "  run DIR               train with a compiled output\n"
      "  generate DIR --weights PATH --prompt TEXT\n"
      "                        generate text with a plan compiled with\n"
      "                        --inference\n"
      "  inspect DIR --ir STAGE | --plan | --source | --comm | --memory\n"
      "  data prepare ...      tokenize text (bytes or GPT-2 BPE) into llm.c\n"
      "                        or Megatron data; also encode, synth, bench,\n"
      "                        inspect\n"
      "  ckpt list|verify|...  list, verify, diff or export checkpoints\n"
      "  export SRC --to hf DIR\n"
      "                        a checkpoint or saved weights as a Hugging\n"
      "                        Face model directory (config.json, ...)\n"
      "  report DIR --metrics F [--trace P --comm-report P]\n"
      "                        a run's charts as one HTML page\n"
      "  trace merge TRACE -o OUT\n"
      "                        the ranks' traces as one, on one clock\n"
      "  check SPEC --dp N ... train a layout and one rank; compare them\n"
      "  simulate DIR --gpu a100-80g --nodes N | --cluster FILE\n"
      "                        replay the compiled step on a cluster: step\n"
      "                        time, its breakdown, tokens/s, MFU\n"
      "  plan SPEC --gpus N --gpu a100-80g\n"
      "                        choose a layout: compile and simulate the most\n"
      "                        promising, ranked\n"
      "  calibrate -o FILE [--ranks N --threads T]\n"
      "                        measure this machine as a cluster description\n"
      "  gradcheck SPEC        check gradients against finite differences\n"
      "  --version             print Tessel's version\n"
      "Run 'tessel <command> --help' for a command's options.\n";
  if (argc < 2) {
    errs() << usage;
    return 2;
  }
  std::string command = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  if (command == "compile") {
    std::string name = "tessel compile";
    argv[1] = name.data();
    return compileCommand(argc - 1, argv + 1);
  }
  if (command == "gradcheck") {
    std::string name = "tessel gradcheck";
    argv[1] = name.data();
    return gradcheckCommand(argc - 1, argv + 1);
  }
  if (command == "check") {
    std::string name = "tessel check";
    argv[1] = name.data();
    return checkCommandLine(argc - 1, argv + 1);
  }
  if (command == "run")
    return tessel::runCommand(rest);
  if (command == "inspect") {
    // plan.json may have been edited: a field of the wrong type is an
    // error, not an abort.
    try {
      return tessel::inspectCommand(rest);
    } catch (const std::exception &e) {
      errs() << "tessel: error: " << (rest.empty() ? "" : rest[0])
             << "/plan.json: malformed (" << e.what() << "); compile again\n";
      return 1;
    }
  }
  if (command == "data")
    return tessel::dataCommand(rest);
  if (command == "ckpt")
    return tessel::ckptCommand(rest);
  if (command == "trace")
    return tessel::traceCommand(rest);
  if (command == "export")
    return tessel::exportCommand(rest);
  if (command == "report")
    return tessel::reportCommand(rest);
  if (command == "generate")
    return tessel::generateCommand(rest);
  if (command == "simulate")
    return tessel::simulateCommand(rest);
  if (command == "calibrate")
    return tessel::calibrateCommand(rest);
  if (command == "plan")
    return tessel::planCommand(rest);
  if (command == "--version" || command == "version") {
    outs() << "tessel " << TESSEL_VERSION << "\n";
    return 0;
  }
  if (command == "--help" || command == "-h" || command == "help") {
    outs() << usage;
    return 0;
  }
  errs() << "tessel: unknown command '" << command << "'\n" << usage;
  return 2;
}
