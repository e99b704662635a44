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
        The scalar arguments after the buffers, in order (a null attribute
        for an absent optional one).
      }],
      "void", "getCallAttributes",
      (ins "::llvm::SmallVectorImpl<::mlir::Attribute> &":$attrs), [{}], [{
        for (::llvm::StringRef name : ConcreteOp::getAttributeNames())
          attrs.push_back($_op->getAttr(name));
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
