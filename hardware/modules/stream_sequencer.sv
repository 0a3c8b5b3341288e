// stream_sequencer: the valid/ready handshake of a stage that takes a whole vector, then emits it in blocks.
// It takes BEATS input beats (data_in_0_ready); then, per output block, BEATS cycles of work if COMPUTE != 0
// and one output beat (data_out_0_valid) held until taken; after the last of BLOCKS blocks, the next vector.
// The owner's datapath follows `take` (an input beat is taken this cycle), `work` (a work cycle), `beat` (the
// input beat taken, or the one worked on) and `block`. Used by fixed_linear and fixed_argmax: its ports carry
// their names (MASE's stream interface), so an owner connects it with `.*`.
`timescale 1ns / 1ps
module stream_sequencer #(
    parameter int BEATS = 4,
    parameter int BLOCKS = 1,
    parameter int COMPUTE = 0,
    parameter int BEAT_BITS = BEATS > 1 ? $clog2(BEATS) : 1,  // derived: not to be overridden
    parameter int BLOCK_BITS = BLOCKS > 1 ? $clog2(BLOCKS) : 1
) (
    input  logic clk,
    input  logic rst,
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic data_out_0_valid,
    input  logic data_out_0_ready,
    output logic take,
    output logic work,
    output logic [BEAT_BITS-1:0] beat,
    output logic [BLOCK_BITS-1:0] block
);
  typedef enum logic [1:0] {
    COLLECT,
    COMPUTING,
    EMIT
  } state_t;
  state_t state, after_block;
  logic last_beat, last_block;

  assign data_in_0_ready = state == COLLECT;
  assign data_out_0_valid = state == EMIT;
  assign work = state == COMPUTING;
  assign take = data_in_0_valid && data_in_0_ready;
  assign last_beat = int'(beat) == BEATS - 1;
  assign last_block = int'(block) == BLOCKS - 1;
  assign after_block = COMPUTE != 0 ? COMPUTING : EMIT;  // where a collected vector (or a next block) goes

  always_ff @(posedge clk) begin
    if (rst) begin
      state <= COLLECT;
      beat  <= '0;
      block <= '0;
    end else begin
      if (take || work) beat <= last_beat ? '0 : beat + 1'b1;
      case (state)
        COLLECT: if (data_in_0_valid && last_beat) state <= after_block;
        COMPUTING: if (last_beat) state <= EMIT;
        default:
        if (data_out_0_ready) begin
          block <= last_block ? '0 : block + 1'b1;
          state <= last_block ? COLLECT : after_block;
        end
      endcase
    end
  end
endmodule
