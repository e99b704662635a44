// Every graph op prints and parses back to itself.

func.func @forward_ops() -> tensor<f32> {
  %w = graph.param "w" {init = "normal", std = 0.01 : f64} : tensor<16x48xf32>
  %lw = graph.param "ln.weight" {init = "ones"} : tensor<16xf32>
  %lb = graph.param "ln.bias" {init = "zeros"} : tensor<16xf32>
  %wte = graph.param "wte" : tensor<32x16xf32>
  %ids = graph.input "tokens" : tensor<2x8xi32>
  %tg = graph.input "targets" : tensor<2x8xi32>
  %x = graph.embedding %wte, %ids : (tensor<32x16xf32>, tensor<2x8xi32>) -> tensor<2x8x16xf32>
  %h = graph.layer_norm %x, %lw, %lb {epsilon = 1.0e-5 : f64} : (tensor<2x8x16xf32>, tensor<16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  %r = graph.rms_norm %x, %lw : (tensor<2x8x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  %qkv = graph.matmul %h, %w : (tensor<2x8x16xf32>, tensor<16x48xf32>) -> tensor<2x8x48xf32>
  %q, %k, %v = graph.split %qkv {axis = 2 : i64} : (tensor<2x8x48xf32>) -> (tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>)
  %c = graph.concat %q, %k {axis = 2 : i64} : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x32xf32>
  %q4 = graph.reshape %q : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  %k4 = graph.reshape %k : (tensor<2x8x16xf32>) -> tensor<2x8x2x8xf32>
  %k2 = graph.reshape %k : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  %v2 = graph.reshape %v : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  %qr = graph.rope %q4 {theta = 500000.0 : f64} : (tensor<2x8x4x4xf32>) -> tensor<2x8x4x4xf32>
  %a, %lse = graph.attention %qr, %k2, %v2 : (tensor<2x8x4x4xf32>, tensor<2x8x4x4xf32>, tensor<2x8x4x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x4x8xf32>)
  %t = graph.transpose %a {permutation = array<i64: 0, 2, 1, 3>} : (tensor<2x8x4x4xf32>) -> tensor<2x4x8x4xf32>
  %a3 = graph.reshape %a : (tensor<2x8x4x4xf32>) -> tensor<2x8x16xf32>
  %g = graph.gelu %a3 : (tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  %s = graph.silu %g : (tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  %m = graph.mul %s, %lw : (tensor<2x8x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  %y = graph.add %m, %r : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  %logits = graph.matmul %y, %wte {transpose_rhs = true} : (tensor<2x8x16xf32>, tensor<32x16xf32>) -> tensor<2x8x32xf32>
  %p = graph.softmax %logits : (tensor<2x8x32xf32>) -> tensor<2x8x32xf32>
  %loss = graph.cross_entropy %logits, %tg : (tensor<2x8x32xf32>, tensor<2x8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

func.func @gradient_ops(%x: tensor<4x16xf32>, %w: tensor<16xf32>, %q: tensor<2x8x4x4xf32>,
                        %kv: tensor<2x8x2x4xf32>, %l: tensor<2x8x32xf32>, %t: tensor<2x8xi32>,
                        %e: tensor<2x8x16xf32>, %one: tensor<f32>) {
  %f = graph.fill {value = 1.0 : f64} : tensor<f32>
  %rs = graph.reduce_sum %x : (tensor<4x16xf32>) -> tensor<16xf32>
  %gg = graph.gelu_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  %sg = graph.silu_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  %dx, %dw, %db = graph.layer_norm_grad %x, %w, %x : (tensor<4x16xf32>, tensor<16xf32>, tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>)
  %rx, %rw = graph.rms_norm_grad %x, %w, %x : (tensor<4x16xf32>, tensor<16xf32>, tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<16xf32>)
  %lse = graph.fill {value = 0.0 : f64} : tensor<2x4x8xf32>
  %dq, %dk, %dv = graph.attention_grad %q, %kv, %kv, %q, %lse, %q : (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x4x4xf32>, tensor<2x4x8xf32>, tensor<2x8x4x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>)
  %smg = graph.softmax_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  %ceg = graph.cross_entropy_grad %l, %t, %one : (tensor<2x8x32xf32>, tensor<2x8xi32>, tensor<f32>) -> tensor<2x8x32xf32>
  %eg = graph.embedding_grad %t, %e : (tensor<2x8xi32>, tensor<2x8x16xf32>) -> tensor<32x16xf32>
  %n = graph.global_norm %x, %w : (tensor<4x16xf32>, tensor<16xf32>) -> tensor<f32>
  return
}

func.func @optimizer(%g: tensor<16xf32>, %n: tensor<f32>) {
  %p = graph.param "b" {init = "zeros"} : tensor<16xf32>
  graph.adamw %p, %g, %n {beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.0 : f64, max_grad_norm = 1.0 : f64} : tensor<16xf32>, tensor<16xf32>, tensor<f32>
  return
}
