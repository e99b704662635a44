
pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
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

// One rank holding two stages: no transfers, the stages run in order.
pipe.schedule "interleaved" ranks 1 microbatches 1 virtual_stages 2 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    pipe.forward stage 1 microbatch 0
    pipe.backward stage 1 microbatch 0
    pipe.backward stage 0 microbatch 0
  }
}
