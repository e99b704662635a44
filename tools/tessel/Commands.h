//===- Commands.h - The subcommands of `tessel` -----------------*- C++ -*-===//
#ifndef TESSEL_TOOLS_TESSEL_COMMANDS_H
#define TESSEL_TOOLS_TESSEL_COMMANDS_H

#include "llvm/ADT/ArrayRef.h"
#include <string>

namespace tessel {
int runCommand(llvm::ArrayRef<std::string> args);
int inspectCommand(llvm::ArrayRef<std::string> args);
int dataCommand(llvm::ArrayRef<std::string> args);
} // namespace tessel

#endif
