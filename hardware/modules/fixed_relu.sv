// fixed_relu: max(x, 0) on each element (exact in any fixed-point format). Combinational; the handshake passes
// through (stream_join).
`timescale 1ns / 1ps
module fixed_relu #(
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1
) (
    /* verilator lint_off UNUSEDSIGNAL */
    input  logic clk,
    input  logic rst,
    /* verilator lint_on UNUSEDSIGNAL */
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_IN_0_PRECISION_0-1:0] data_out_0 [DATA_IN_0_PARALLELISM_DIM_0],
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
    assign data_out_0[i] = data_in_0[i][DATA_IN_0_PRECISION_0-1] ? '0 : data_in_0[i];
  end
endmodule
