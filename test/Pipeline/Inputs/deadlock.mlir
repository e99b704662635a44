// Rank 0 waits for the gradient before sending the activation rank 1 needs
// to produce it: each rank waits on the other.

pipe.schedule "1f1b" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    pipe.recv "gradient" stage 1 microbatch 0 from 1
    pipe.send "activation" stage 0 microbatch 0 to 1
    pipe.backward stage 0 microbatch 0
  }
  pipe.rank 1 {
    pipe.recv "activation" stage 0 microbatch 0 from 0
    pipe.forward stage 1 microbatch 0
    pipe.backward stage 1 microbatch 0
    pipe.send "gradient" stage 1 microbatch 0 to 0
  }
}
