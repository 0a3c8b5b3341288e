// fixed_requant: each element from fixed point (DATA_IN_0_PRECISION_0, _1) to (DATA_OUT_0_PRECISION_0, _1)
// (width, fraction width), rounding half to even and saturating, as fxforge's fixed-point quantizer does.
// Combinational; the valid/ready handshake passes through (stream_join).
`timescale 1ns / 1ps
module fixed_requant #(
    parameter int DATA_IN_0_PRECISION_0 = 16,
    parameter int DATA_IN_0_PRECISION_1 = 8,
    parameter int DATA_OUT_0_PRECISION_0 = 8,
    parameter int DATA_OUT_0_PRECISION_1 = 4,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1
) (
    /* verilator lint_off UNUSEDSIGNAL */
    input  logic clk,
    input  logic rst,
    /* verilator lint_on UNUSEDSIGNAL */
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_OUT_0_PRECISION_0-1:0] data_out_0 [DATA_IN_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
  stream_join #(
      .N(1)
  ) u_handshake (
      .in_valid (data_in_0_valid),
      .in_ready (data_in_0_ready),
      .out_valid(data_out_0_valid),
      .out_ready(data_out_0_ready)
  );
  for (genvar i = 0; i < DATA_IN_0_PARALLELISM_DIM_0; i++) begin : g_elem
    fixed_round_saturate #(
        .IN_WIDTH (DATA_IN_0_PRECISION_0),
        .IN_FRAC  (DATA_IN_0_PRECISION_1),
        .OUT_WIDTH(DATA_OUT_0_PRECISION_0),
        .OUT_FRAC (DATA_OUT_0_PRECISION_1)
    ) u_cast (
        .data_in (data_in_0[i]),
        .data_out(data_out_0[i])
    );
  end
endmodule
