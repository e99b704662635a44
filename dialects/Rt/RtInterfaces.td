//===- RtInterfaces.td - Interfaces of the rt dialect -------*- tablegen -*-===//
#ifndef TESSEL_RT_INTERFACES
#define TESSEL_RT_INTERFACES

include "mlir/IR/OpBase.td"

def KernelCallOpInterface : OpInterface<"KernelCallOpInterface"> {
  let cppNamespace = "::tessel::rtir";
  let description = [{
    An op that is one call of a runtime function: the function's name, then
    its arguments in order, the op's buffers (operands) followed by its
    attributes in the order the op declares them. The conversion to `emitc`
    turns every such op into a call with one pattern.
  }];
  let methods = [
    StaticInterfaceMethod<"The runtime function called.",
      "::llvm::StringRef", "getFunction", (ins), [{}],
      [{ return ConcreteOp::kFunction; }]>,
    InterfaceMethod<[{
        The call's arguments in order: the op's arguments as it declares
        them (ConcreteOp::kArguments), each a buffer or scalar operand (a
        null value for an absent optional one) or an attribute.
      }],
      "void", "getCallArguments",
      (ins "::llvm::SmallVectorImpl<::tessel::rtir::CallArgument> &":$args),
      [{}], [{
        ::llvm::ArrayRef<::llvm::StringRef> attrs =
            ConcreteOp::getAttributeNames();
        unsigned operand = 0;
        for (::llvm::StringRef name : ConcreteOp::kArguments) {
          if (::llvm::is_contained(attrs, name)) {
            args.push_back({::mlir::Value(), $_op->getAttr(name)});
            continue;
          }
          auto range = $_op.getODSOperands(operand++);
          args.push_back({range.empty() ? ::mlir::Value() : *range.begin(),
                          ::mlir::Attribute()});
        }
      }]>,
  ];
}

def CommunicationOpInterface : OpInterface<"CommunicationOpInterface"> {
  let cppNamespace = "::tessel::rtir";
  let description = [{
    An op that moves data between ranks. It says, per call, what the
    runtime's counters will count (the collective, its group, the elements
    passed and the bytes a rank sends by the textbook formulas of
    tessel/Runtime/CommVolume.h), which is what plan.json predicts and
    `--comm-report` checks.
  }];
  let methods = [
    InterfaceMethod<"The collectives one execution performs.", "void",
      "describeCommunication",
      (ins "const ::tessel::MeshShape &":$mesh,
           "::llvm::SmallVectorImpl<::tessel::rtir::CollectiveRecord> &":$records)>,
  ];
}

#endif // TESSEL_RT_INTERFACES
