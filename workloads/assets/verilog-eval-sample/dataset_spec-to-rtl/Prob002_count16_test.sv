`timescale 1 ps/1 ps

module stimulus_gen (
  input clk,
  output logic reset
);
  initial begin
    reset = 1;
    repeat (2) @(negedge clk);
    reset = 0;
    repeat (40) @(negedge clk);
    repeat (100) @(negedge clk) reset = ($random & 15) == 0;
    @(negedge clk) $finish;
  end
endmodule

module tb();
  logic clk = 0;
  always #5 clk = ~clk;

  logic reset;
  logic [3:0] q_ref, q_dut;
  int compared = 0;
  int wrong = 0;

  stimulus_gen stim1 (.clk, .reset);
  RefModule good1 (.clk, .reset, .q(q_ref));
  TopModule top_module1 (.clk, .reset, .q(q_dut));

  wire same = ( q_ref === ( q_ref ^ q_dut ^ q_ref ) );

  // Compare on both edges, after the first reset has taken effect.
  always @(posedge clk, negedge clk) begin
    if ($time > 20) begin
      compared++;
      if (!same) wrong++;
    end
  end

  final begin
    $display("Hint: %0d of %0d comparisons differ", wrong, compared);
    $display("Mismatches: %1d in %1d samples", wrong, compared);
  end
endmodule
