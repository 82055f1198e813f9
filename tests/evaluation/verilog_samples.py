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

# Wrong logic (y stuck at 0) that holds its own inputs at 0, where the reference's output is 0
# too: the input ports are the testbench's nets, so the reference sees the same forced inputs.
# Every way of driving a net iverilog elaborates, each on input port `a` (b and c the same way).
_STUCK_HEADER = "module TopModule (input a, input b, input c, output y);\n  assign y = 1'b0;\n"
_ZERO_SOURCE = "module Zero (output q);\n  assign q = 1'b0;\nendmodule\n"
DRIVES_ITS_INPUTS = {
    "forces_them": _STUCK_HEADER
    + "  initial begin force a = 1'b0; force b = 1'b0; force c = 1'b0; end\nendmodule\n",
    "forces_a_part_later": _STUCK_HEADER.replace("input c", "input [0:0] c")
    + "  initial begin #1 force a = 1'b0; force b = 1'b0; force c[0] = 1'b0; end\nendmodule\n",
    "shorts_them_to_ground": _STUCK_HEADER
    + "  supply0 gnd;\n  tran t1 (a, gnd);\n  tran t2 (b, gnd);\n  tranif1 t3 (c, gnd, 1'b1);\n"
    + "endmodule\n",
    "assigns_them": _STUCK_HEADER
    + "  assign (supply0, supply1) a = 1'b0;\n  assign (supply0, supply1) b = 1'b0;\n"
    + "  assign (supply0, supply1) c = 1'b0;\nendmodule\n",
    "drives_them_from_a_submodule": _ZERO_SOURCE
    + _STUCK_HEADER
    + "  Zero z1 (.q(a));\n  Zero z2 (.q(b));\n  Zero z3 (.q(c));\nendmodule\n",
    "forces_them_from_a_submodule": "module Hold;\n"
    + "  initial begin force TopModule.a = 1'b0; force TopModule.b = 1'b0; "
    + "force TopModule.c = 1'b0; end\nendmodule\n"
    + _STUCK_HEADER
    + "  Hold h ();\nendmodule\n",
}
# Correct logic that reads two inputs through a submodule's inout port, joined by a
# concatenation: iverilog links them with bidirectional part selects (tran(VP), as a tran
# primitive) that nothing drives. Read, not driven: it passes.
MAJORITY_THROUGH_AN_INOUT = (
    "module maj2 (inout [1:0] p, input q, output r);\n"
    + "  assign r = (p[0] & p[1]) | (p[0] & q) | (p[1] & q);\nendmodule\n"
    + _HEADER
    + "  maj2 u (.p({a, b}), .q(c), .r(y));\nendmodule\n"
)
# The same island with a driver in it: the submodule drives its inout port, so the inputs.
DRIVES_ITS_INPUTS["drives_them_through_an_inout"] = (
    "module hold2 (inout [1:0] p);\n  assign p = 2'b00;\nendmodule\n"
    + _STUCK_HEADER
    + "  hold2 u (.p({a, b}));\n  tran t (c, u.p[0]);\nendmodule\n"
)
# The same through $deposit, a system task that writes a net's value whatever drives it (not an
# elaborated driver: the preprocessed text is checked for it).
DEPOSITS_INTO_ITS_INPUTS = (
    _STUCK_HEADER
    + "  always @(a or b or c) begin\n"
    + "    $deposit(a, 1'b0); $deposit(b, 1'b0); $deposit(c, 1'b0);\n  end\nendmodule\n"
)
# Correct logic whose inputs go through a submodule's input, an alias wire and a tran-free
# buffer: reading an input port, however indirectly, is not driving it.
MAJORITY_READS_ITS_INPUTS = (
    "module and2 (input p, input q, output r);\n  assign r = p & q;\nendmodule\n"
    + _HEADER
    + "  wire a_copy = a;\n  wire ab, ac, bc;\n  buf (bc_in, b);\n"
    + "  and2 u_ab (.p(a_copy), .q(b), .r(ab));\n  and2 u_ac (.p(a), .q(c), .r(ac));\n"
    + "  and2 u_bc (.p(bc_in), .q(c), .r(bc));\n  assign y = ab | ac | bc;\nendmodule\n"
)


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
