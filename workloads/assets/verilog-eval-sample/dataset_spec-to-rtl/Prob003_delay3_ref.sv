
module RefModule (
  input clk,
  input reset,
  input start,
  output done
);

  logic [2:0] pipe;

  always @(posedge clk)
    if (reset)
      pipe <= 3'b000;
    else
      pipe <= {pipe[1:0], start};

  assign done = pipe[2];

endmodule

