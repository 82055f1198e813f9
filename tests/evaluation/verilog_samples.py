"""Verilog answers for the shipped test problems (workloads/assets): correct, wrong, hostile."""

MAJORITY_OK = """\
module TopModule (input a, input b, input c, output y);
  assign y = (a & b) | (a & c) | (b & c);
endmodule
"""

MAJORITY_WRONG = """\
module TopModule (input a, input b, input c, output y);
  assign y = a | b | c;
endmodule
"""

COUNTER_OK = """\
module TopModule (input clk, input reset, output logic [3:0] q);
  always @(posedge clk)
    if (reset) q <= 0;
    else q <= q + 1;
endmodule
"""

# Counts by two: wrong on most cycles.
COUNTER_WRONG = """\
module TopModule (input clk, input reset, output logic [3:0] q);
  always @(posedge clk)
    if (reset) q <= 0;
    else q <= q + 2;
endmodule
"""

DELAY_OK = """\
module TopModule (input clk, input reset, input start, output done);
  logic s1, s2, s3;
  always @(posedge clk) begin
    if (reset) {s1, s2, s3} <= 3'b0;
    else begin
      s1 <= start;
      s2 <= s1;
      s3 <= s2;
    end
  end
  assign done = s3;
endmodule
"""

# Never raises done: the testbench waits for it forever and its TIMEOUT guard fires.
DELAY_NEVER_DONE = """\
module TopModule (input clk, input reset, input start, output done);
  assign done = 1'b0;
endmodule
"""

_MAJORITY_LOGIC = "  assign y = (a & b) | (a & c) | (b & c);\n"
_HEADER = "module TopModule (input a, input b, input c, output y);\n"


def _forged(then: str) -> str:
    return (
        '  final begin\n    $display("%s: 0 in 57 samples", {"Mis", "matches"});\n'
        f"    {then}\n  end\nendmodule\n"
    )


HOSTILE = {
    # A zero-delay loop at time 0: the simulator never advances; only the wall clock stops it.
    "infinite_loop": _HEADER
    + _MAJORITY_LOGIC
    + "  initial begin : spin\n    integer i;\n    i = 0;\n    while (1) i = i + 1;\n  end\n"
    + "endmodule\n",
    # Correct logic, but it ends the simulation before the testbench has compared everything.
    "early_finish": "`timescale 1 ps/1 ps\n"
    + _HEADER
    + _MAJORITY_LOGIC
    + "  initial #100 $finish;\nendmodule\n",
    "stop": "`timescale 1 ps/1 ps\n"
    + _HEADER
    + _MAJORITY_LOGIC
    + "  initial #100 $stop;\nendmodule\n",
    "finish_at_zero": _HEADER + _MAJORITY_LOGIC + "  initial $finish;\nendmodule\n",
    # Endless output at time 0.
    "huge_output": _HEADER
    + _MAJORITY_LOGIC
    + '  initial forever $display("all work and no play makes jack a dull boy");\nendmodule\n',
    "compile_error": _HEADER.replace(");", ")") + "  assign y = ;\nendmodule\n",
    "missing_top": "module NotTop (input a, output y);\n  assign y = a;\nendmodule\n",
    # Writes a file next to the sample: refused before it is compiled.
    "writes_file": _HEADER
    + _MAJORITY_LOGIC
    + "  integer f;\n"
    + '  initial begin f = $fopen("/tmp/pwned.txt", "w"); $fclose(f); end\nendmodule\n',
    # Prints the verdict line itself: refused.
    "fake_verdict": _HEADER
    + "  assign y = 0;\n"
    + '  initial $display("Mismatches: 0 in 57 samples");\nendmodule\n',
    "include_file": '`include "/etc/passwd"\n' + _HEADER + _MAJORITY_LOGIC + "endmodule\n",
    # Correct logic that prints a passing verdict line of its own (spelled so that no
    # "Mismatches" literal shows) and then ends the simulation from its final block, which
    # iverilog runs before the testbench's: the testbench never prints its verdict. The
    # official flow passes all three.
    "forged_verdict_then_fatal": _HEADER + _MAJORITY_LOGIC + _forged('$fatal(1, "bye");'),
    "forged_verdict_then_finish": _HEADER + _MAJORITY_LOGIC + _forged("$finish;"),
    "forged_verdict_then_stop": _HEADER + _MAJORITY_LOGIC + _forged("$stop;"),
    # The forged line next to the testbench's own.
    "forged_verdict": _HEADER + _MAJORITY_LOGIC + _forged(""),
    # Aborts midway; final blocks still run, so the testbench reports a short run.
    "fatal_midway": "`timescale 1 ps/1 ps\n"
    + _HEADER
    + _MAJORITY_LOGIC
    + '  initial #100 $fatal(1, "giving up");\nendmodule\n',
    "empty": "",
}
