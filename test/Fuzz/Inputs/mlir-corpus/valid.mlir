// pp=2, one microbatch, sends placed right after the producing step.
pipe.schedule "1f1b" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    pipe.send "activation" stage 0 microbatch 0 to 1
    pipe.recv "gradient" stage 1 microbatch 0 from 1
    pipe.backward stage 0 microbatch 0
  }
  pipe.rank 1 {
    pipe.recv "activation" stage 0 microbatch 0 from 0
    pipe.forward stage 1 microbatch 0
    pipe.backward stage 1 microbatch 0
    pipe.send "gradient" stage 1 microbatch 0 to 0
  }
}
