// RUN: tessel-opt %s -split-input-file -verify-diagnostics

// expected-error@+1 {{mesh axis tp must have size >= 1}}
module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 0>} {}

// -----

// expected-error@+1 {{unknown mesh axis 'xp'}}
module attributes {dist.mesh = #dist.mesh<xp = 2>} {}

// -----

// expected-error@+1 {{dist.mesh must be a #dist.mesh<...>}}
module attributes {dist.mesh = 4} {}

// -----

module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 4>} {
func.func @gather(%x: tensor<2x16x64xf32>) {
  // expected-error@+1 {{result dimension 1 must be 64 for a group of 4, got 32}}
  %y = dist.all_gather %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x16x64xf32>) -> tensor<2x32x64xf32>
  return
}
}

// -----

module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 4>} {
func.func @scatter(%x: tensor<2x64x64xf32>) {
  // expected-error@+1 {{input dimension 1 must be 32 for a group of 2, got 64}}
  %y = dist.reduce_scatter %x {axes = #dist.axes<dp>, dim = 1 : i64} : (tensor<2x64x64xf32>) -> tensor<2x16x64xf32>
  return
}
}

// -----

func.func @reduce(%x: tensor<4xf32>) {
  // expected-error@+1 {{needs at least one mesh axis}}
  %y = dist.all_reduce %x {axes = #dist.axes<>} : (tensor<4xf32>) -> tensor<4xf32>
  return
}

// -----

func.func @twice_axis(%x: tensor<4xf32>) {
  // expected-error@+1 {{mesh axis 'dp' appears twice}}
  %y = dist.all_reduce %x {axes = #dist.axes<dp, dp>} : (tensor<4xf32>) -> tensor<4xf32>
  return
}

// -----

func.func @reduce_types(%x: tensor<4xf32>) {
  // expected-error@+1 {{result types must equal the operand types}}
  %y = dist.all_reduce %x {axes = #dist.axes<dp>} : (tensor<4xf32>) -> tensor<8xf32>
  return
}

// -----

module attributes {dist.mesh = #dist.mesh<dp = 2>} {
func.func @root(%x: tensor<4xf32>) {
  // expected-error@+1 {{root 2 is outside the group of 2}}
  %y = dist.broadcast %x {axes = #dist.axes<dp>, root = 2 : i64} : (tensor<4xf32>) -> tensor<4xf32>
  return
}
}

// -----

// expected-error@+1 {{a mesh axis is used twice in one sharding}}
func.func @twice(%x: tensor<2x16xf32> {dist.sharding = #dist.sharding<[[dp], [dp]], partial = []>}) {
  return
}

// -----

// expected-error@+1 {{blocks must give a count >= 1 for each dimension}}
func.func @blocks(%x: tensor<2x16xf32> {dist.sharding = #dist.sharding<[[], [tp]], partial = [], blocks = [3]>}) {
  return
}

// -----

func.func @slice(%k: tensor<8x64x2x16xf32>) {
  // expected-error@+1 {{shapes may differ only along dim 2}}
  %k1 = dist.local_slice %k {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x2x16xf32>) -> tensor<8x32x1x16xf32>
  return
}
