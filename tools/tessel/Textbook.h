//===- Textbook.h - What a layout should cost, by the formulas --*- C++ -*-===//
//
// The one place that states the textbook communication volume of a layout
// (docs/parallelism.md gives the formulas): per rank and step, per group of
// mesh axes, from the model's sizes, the layout and the parameters a rank
// holds, never from the compiled program. `tessel inspect --comm
// --textbook` prints it beside what the plan predicts.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_TOOLS_TESSEL_TEXTBOOK_H
#define TESSEL_TOOLS_TESSEL_TEXTBOOK_H

#include "llvm/Support/Error.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace tessel {

// Bytes a rank of one program sends per step, by group of mesh axes as
// plan.json spells them ("dp", "tp", "dp,tp", "pp"). Collectives of one
// element (the loss and the gradient norm's squares) are left out of both
// sides.
struct CommTable {
  std::map<std::string, double> textbook, predicted;
  double scalarBytes = 0; // predicted, not compared
};

llvm::Expected<CommTable> commTextbook(const nlohmann::json &plan,
                                       const std::string &program);

// Bytes a rank of one program holds, by class, beside the textbook's: the
// model state (fp32 parameters, gradients, AdamW moments; the bf16 copy)
// from the parameters it holds, and what a microbatch in flight keeps from
// its forward to its backward pass, per transformer block (Korthikanti et
// al. with flash attention and without dropout).
struct MemoryRow {
  std::string what;
  double predicted = 0, textbook = 0;
  std::string note; // why a row is not compared
};
llvm::Expected<std::vector<MemoryRow>>
memoryTextbook(const nlohmann::json &plan, const std::string &program);

} // namespace tessel

#endif
