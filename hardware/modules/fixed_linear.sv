// fixed_linear: y = W x (+ b) over a streamed input vector, exact in the accumulator format
// (DATA_OUT_0_PRECISION_0, DATA_OUT_0_PRECISION_1); the output is rounded by a following fixed_requant.
// Input: DATA_IN_0_TENSOR_SIZE_DIM_0 elements, DATA_IN_0_PARALLELISM_DIM_0 per beat, buffered whole.
// Then for each block of DATA_OUT_0_PARALLELISM_DIM_0 outputs: one cycle per input beat
// (DATA_OUT_0_PARALLELISM_DIM_0 * DATA_IN_0_PARALLELISM_DIM_0 multipliers), then one output beat.
// Weights and bias come from ROMs initialised by $readmemh (WEIGHT_ROM, BIAS_ROM): weight word
// (block, beat) holds element (j, i) at bits [(j * P_IN + i) * WEIGHT_PRECISION_0 +: WEIGHT_PRECISION_0].
// The handshake and the beat / block counters: stream_sequencer.
`timescale 1ns / 1ps
module fixed_linear #(
    parameter int HAS_BIAS = 1,
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_PRECISION_1 = 4,
    parameter int DATA_IN_0_TENSOR_SIZE_DIM_0 = 8,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1,
    parameter int WEIGHT_PRECISION_0 = 8,
    parameter int WEIGHT_PRECISION_1 = 4,
    parameter int BIAS_PRECISION_0 = 8,
    parameter int BIAS_PRECISION_1 = 4,
    parameter int DATA_OUT_0_PRECISION_0 = 20,
    parameter int DATA_OUT_0_PRECISION_1 = 8,
    parameter int DATA_OUT_0_TENSOR_SIZE_DIM_0 = 4,
    parameter int DATA_OUT_0_PARALLELISM_DIM_0 = 1,
    parameter WEIGHT_ROM = "weight.mem",
    parameter BIAS_ROM = "bias.mem"
) (
    input  logic clk,
    input  logic rst,
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_OUT_0_PRECISION_0-1:0] data_out_0 [DATA_OUT_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
  localparam int P_IN = DATA_IN_0_PARALLELISM_DIM_0;
  localparam int P_OUT = DATA_OUT_0_PARALLELISM_DIM_0;
  localparam int BEATS = DATA_IN_0_TENSOR_SIZE_DIM_0 / P_IN;
  localparam int BLOCKS = DATA_OUT_0_TENSOR_SIZE_DIM_0 / P_OUT;
  localparam int DW = DATA_IN_0_PRECISION_0;
  localparam int WW = WEIGHT_PRECISION_0;
  localparam int AW = DATA_OUT_0_PRECISION_0;
  localparam int PROD_SHIFT = DATA_OUT_0_PRECISION_1 - DATA_IN_0_PRECISION_1 - WEIGHT_PRECISION_1;
  localparam int BIAS_SHIFT = DATA_OUT_0_PRECISION_1 - BIAS_PRECISION_1;
  localparam int BEAT_BITS = BEATS > 1 ? $clog2(BEATS) : 1;
  localparam int BLOCK_BITS = BLOCKS > 1 ? $clog2(BLOCKS) : 1;

  // the weights of one (block, beat) pair per word
  logic [P_OUT*P_IN*WW-1:0] weight_rom[BLOCKS*BEATS];
  initial $readmemh(WEIGHT_ROM, weight_rom);

  logic take, work;
  logic [BEAT_BITS-1:0] beat;
  logic [BLOCK_BITS-1:0] block;
  stream_sequencer #(
      .BEATS  (BEATS),
      .BLOCKS (BLOCKS),
      .COMPUTE(1)
  ) u_handshake (.*);
  logic signed [DW-1:0] buffer[DATA_IN_0_TENSOR_SIZE_DIM_0];
  logic signed [AW-1:0] acc[P_OUT];
  logic signed [AW-1:0] partial[P_OUT];
  logic signed [AW-1:0] start[P_OUT];
  logic [P_OUT*P_IN*WW-1:0] word;

  assign word = weight_rom[int'(block)*BEATS+int'(beat)];
  for (genvar j = 0; j < P_OUT; j++) begin : g_out
    assign data_out_0[j] = acc[j];
  end

  if (HAS_BIAS != 0) begin : g_bias
    logic [P_OUT*BIAS_PRECISION_0-1:0] bias_rom[BLOCKS];
    initial $readmemh(BIAS_ROM, bias_rom);
    for (genvar j = 0; j < P_OUT; j++) begin : g_start
      assign start[j] = AW'($signed(bias_rom[block][j*BIAS_PRECISION_0+:BIAS_PRECISION_0])) <<< BIAS_SHIFT;
    end
  end else begin : g_no_bias
    for (genvar j = 0; j < P_OUT; j++) begin : g_start
      assign start[j] = '0;
    end
  end

  // P_OUT dot products of one beat of the buffered input with the weight word
  always_comb begin
    for (int j = 0; j < P_OUT; j++) begin
      partial[j] = beat == '0 ? start[j] : acc[j];
      for (int i = 0; i < P_IN; i++) begin
        partial[j] = partial[j] + ((AW'(buffer[int'(beat)*P_IN+i]) * AW'($signed(
            word[(j*P_IN+i)*WW+:WW]
        ))) <<< PROD_SHIFT);
      end
    end
  end

  // the buffered input and the accumulators (the sequencer counts beats and blocks)
  always_ff @(posedge clk) begin
    if (!rst) begin
      if (take) for (int i = 0; i < P_IN; i++) buffer[int'(beat)*P_IN+i] <= data_in_0[i];
      if (work) for (int j = 0; j < P_OUT; j++) acc[j] <= partial[j];
    end
  end
endmodule
