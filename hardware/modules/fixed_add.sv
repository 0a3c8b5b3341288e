// fixed_add: a + b elementwise, exact: both aligned to the larger fraction width (DATA_OUT_0_PRECISION_1) in
// DATA_OUT_0_PRECISION_0 bits (one carry bit more than the wider operand). Joins the two streams (stream_join).
`timescale 1ns / 1ps
module fixed_add #(
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_PRECISION_1 = 4,
    parameter int DATA_IN_1_PRECISION_0 = 8,
    parameter int DATA_IN_1_PRECISION_1 = 4,
    parameter int DATA_OUT_0_PRECISION_0 = 9,
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
    input  logic signed [DATA_IN_1_PRECISION_0-1:0] data_in_1 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_1_valid,
    output logic data_in_1_ready,
    output logic signed [DATA_OUT_0_PRECISION_0-1:0] data_out_0 [DATA_IN_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
  localparam int OW = DATA_OUT_0_PRECISION_0;
  localparam int SHIFT_0 = DATA_OUT_0_PRECISION_1 - DATA_IN_0_PRECISION_1;
  localparam int SHIFT_1 = DATA_OUT_0_PRECISION_1 - DATA_IN_1_PRECISION_1;
  logic [1:0] ready;
  stream_join #(
      .N(2)
  ) u_handshake (
      .in_valid ({data_in_1_valid, data_in_0_valid}),
      .in_ready (ready),
      .out_valid(data_out_0_valid),
      .out_ready(data_out_0_ready)
  );
  assign data_in_0_ready = ready[0];
  assign data_in_1_ready = ready[1];
  for (genvar i = 0; i < DATA_IN_0_PARALLELISM_DIM_0; i++) begin : g_elem
    assign data_out_0[i] = (OW'(data_in_0[i]) <<< SHIFT_0) + (OW'(data_in_1[i]) <<< SHIFT_1);
  end
endmodule
