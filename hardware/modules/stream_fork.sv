// stream_fork: one stream to two consumers; each output takes the beat once (eager fork), the input
// advances when both have it.
`timescale 1ns / 1ps
module stream_fork #(
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1
) (
    input  logic clk,
    input  logic rst,
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_IN_0_PRECISION_0-1:0] data_out_0 [DATA_IN_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready,
    output logic signed [DATA_IN_0_PRECISION_0-1:0] data_out_1 [DATA_IN_0_PARALLELISM_DIM_0],
    output logic data_out_1_valid,
    input  logic data_out_1_ready
);
  logic [1:0] done;  // output k already took the current beat
  logic take_0, take_1;
  for (genvar i = 0; i < DATA_IN_0_PARALLELISM_DIM_0; i++) begin : g_copy
    assign data_out_0[i] = data_in_0[i];
    assign data_out_1[i] = data_in_0[i];
  end
  assign data_out_0_valid = data_in_0_valid && !done[0];
  assign data_out_1_valid = data_in_0_valid && !done[1];
  assign take_0 = done[0] || data_out_0_ready;
  assign take_1 = done[1] || data_out_1_ready;
  assign data_in_0_ready = take_0 && take_1;
  always_ff @(posedge clk) begin
    if (rst || (data_in_0_valid && data_in_0_ready)) done <= 2'b00;
    else if (data_in_0_valid) done <= {take_1, take_0};
  end
endmodule
