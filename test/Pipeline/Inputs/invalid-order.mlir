pipe.schedule "gpipe" ranks 1 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.backward stage 0 microbatch 0
    pipe.forward stage 0 microbatch 0
  }
}
