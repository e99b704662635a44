// RUN: tessel-opt %s -split-input-file -verify-diagnostics

// expected-error@+1 {{kind must be "gpipe", "1f1b" or "interleaved", got "zb"}}
pipe.schedule "zb" ranks 1 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    pipe.backward stage 0 microbatch 0
  }
}

// -----

// expected-error@+1 {{has 1 pipe.rank ops but 2 ranks}}
pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  // expected-error@+1 {{is rank 1 at position 0; ranks must be listed in order 0..1}}
  pipe.rank 1 {
  }
  pipe.rank 0 {
  }
}

// -----

pipe.schedule "gpipe" ranks 1 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{stage 1 is out of range (the schedule has 1 stages)}}
    pipe.forward stage 1 microbatch 0
  }
}

// -----

pipe.schedule "gpipe" ranks 1 microbatches 2 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{microbatch 2 is out of range (the schedule has 2 microbatches)}}
    pipe.forward stage 0 microbatch 2
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{stage 1 runs on rank 1, not on rank 0}}
    pipe.forward stage 1 microbatch 0
  }
  pipe.rank 1 {
  }
}

// -----

pipe.schedule "gpipe" ranks 1 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    // expected-error@+1 {{repeats the forward of stage 0 microbatch 0}}
    pipe.forward stage 0 microbatch 0
    pipe.backward stage 0 microbatch 0
  }
}

// -----

pipe.schedule "gpipe" ranks 1 microbatches 2 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    // expected-error@+1 {{comes before the forward of stage 0 microbatch 1}}
    pipe.backward stage 0 microbatch 1
    pipe.forward stage 0 microbatch 1
    pipe.backward stage 0 microbatch 0
  }
}

// -----

// expected-error@+1 {{has no backward of stage 0 microbatch 1 (on rank 0)}}
pipe.schedule "gpipe" ranks 1 microbatches 2 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    pipe.forward stage 0 microbatch 1
    pipe.backward stage 0 microbatch 0
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
  }
  pipe.rank 1 {
    // expected-error@+1 {{comes before the receive of the activation of stage 0 microbatch 0}}
    pipe.forward stage 1 microbatch 0
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{comes before the forward of stage 0 microbatch 0}}
    pipe.send "activation" stage 0 microbatch 0 to 1
  }
  pipe.rank 1 {
  }
}

// -----

pipe.schedule "gpipe" ranks 3 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    pipe.forward stage 0 microbatch 0
    // expected-error@+1 {{sends to rank 2, but the consuming stage 1 runs on rank 1}}
    pipe.send "activation" stage 0 microbatch 0 to 2
  }
  pipe.rank 1 {
  }
  pipe.rank 2 {
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{receives the activation of stage 1, which no stage of rank 0 consumes}}
    pipe.recv "activation" stage 1 microbatch 0 from 1
  }
  pipe.rank 1 {
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{kind must be "activation" or "gradient", got "weights"}}
    pipe.recv "weights" stage 1 microbatch 0 from 1
  }
  pipe.rank 1 {
  }
}

// -----

pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
  pipe.rank 0 {
    // expected-error@+1 {{transfers to its own rank 0}}
    pipe.recv "gradient" stage 1 microbatch 0 from 0
  }
  pipe.rank 1 {
  }
}

// -----

// expected-error@+1 {{'pipe.forward' op expects parent op 'pipe.rank'}}
pipe.forward stage 0 microbatch 0
