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

# Majority built from instances, read through hierarchical names inside the design: its own
# instances (`u_ab.r`), a path from its own module name (`TopModule.u_bc.r`), and an upward name
# from a submodule to its parent's net (`TopModule.ac`). All stay in the design: it passes.
MAJORITY_INTERNAL_NAMES = """\
module and2 (input p, input q, output r);
  assign r = p & q;
endmodule

module or3 (output y);
  assign y = TopModule.u_ab.r | TopModule.ac | TopModule.u_bc.r;
endmodule

module TopModule (input a, input b, input c, output y);
  wire ac;
  and2 u_ab (.p(a), .q(b), .r());
  and2 u_ac (.p(a), .q(c), .r(ac));
  and2 u_bc (.p(b), .q(c), .r());
  or3 u_or (.y(y));
endmodule
"""

# Wrong logic (OR for majority) that writes the testbench's mismatch counter through a name
# that leaves the design (from a final block, which runs before the testbench's, or whenever the
# counter moves), so the testbench reports 0 mismatches. The official flow passes each.
_WRONG_HEADER = "module TopModule (input a, input b, input c, output y);\n  assign y = a | b | c;\n"
REACHES_OUT = {
    "writes_the_counter": _WRONG_HEADER + "  final tb.wrong = 0;\nendmodule\n",
    # The name spelled by macros: the compiler, not the text, decides.
    "writes_the_counter_through_macros": "`define UP(m, n) m.n\n"
    + _WRONG_HEADER
    + "  final `UP(tb, wrong) = 0;\nendmodule\n",
    "forces_the_counter": _WRONG_HEADER + "  final force tb.wrong = 0;\nendmodule\n",
    # A task of the design that does it whenever the counter moves.
    "clears_in_a_task": _WRONG_HEADER
    + "  task clear;\n    tb.wrong = 0;\n  endtask\n  always @(tb.wrong) clear();\nendmodule\n",
}

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
