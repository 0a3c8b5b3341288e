// fixed_argmax: the index of the first largest element of a streamed vector (torch.argmax's tie rule:
// a later element wins only if strictly larger). Emits one index beat after the vector's last beat
// (the handshake: stream_sequencer).
`timescale 1ns / 1ps
module fixed_argmax #(
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_TENSOR_SIZE_DIM_0 = 4,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1,
    parameter int DATA_OUT_0_PRECISION_0 = 3
) (
    input  logic clk,
    input  logic rst,
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_OUT_0_PRECISION_0-1:0] data_out_0 [1],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
  localparam int P = DATA_IN_0_PARALLELISM_DIM_0;
  localparam int BEATS = DATA_IN_0_TENSOR_SIZE_DIM_0 / P;
  localparam int BEAT_BITS = BEATS > 1 ? $clog2(BEATS) : 1;
  localparam int IW = DATA_OUT_0_PRECISION_0;

  logic [BEAT_BITS-1:0] beat;
  logic signed [DATA_IN_0_PRECISION_0-1:0] best, next_best;
  logic [IW-1:0] best_idx, next_idx;
  logic take;
  /* verilator lint_off UNUSEDSIGNAL */
  logic work, block;  // no work cycles, one output block
  /* verilator lint_on UNUSEDSIGNAL */
  stream_sequencer #(
      .BEATS (BEATS),
      .BLOCKS(1)
  ) u_handshake (.*);
  assign data_out_0[0] = best_idx;

  // fold this beat's elements into the running maximum, in order
  always_comb begin
    next_best = best;
    next_idx  = best_idx;
    for (int i = 0; i < P; i++) begin
      if ((beat == '0 && i == 0) || data_in_0[i] > next_best) begin
        next_best = data_in_0[i];
        next_idx  = IW'(int'(beat) * P + i);
      end
    end
  end

  always_ff @(posedge clk) begin
    if (rst) begin
      best <= '0;
      best_idx <= '0;
    end else if (take) begin
      best <= next_best;
      best_idx <= next_idx;
    end
  end
endmodule
