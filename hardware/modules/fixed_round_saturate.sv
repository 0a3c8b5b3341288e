// fixed_round_saturate: one signed fixed-point value from (IN_WIDTH, IN_FRAC) to (OUT_WIDTH, OUT_FRAC):
// a right shift rounds half to even (torch.round), a left shift is exact; the result saturates to
// [-2^(OUT_WIDTH-1), 2^(OUT_WIDTH-1)-1] (torch.clamp). Combinational.
`timescale 1ns / 1ps
module fixed_round_saturate #(
    parameter int IN_WIDTH = 16,
    parameter int IN_FRAC = 8,
    parameter int OUT_WIDTH = 8,
    parameter int OUT_FRAC = 4
) (
    input  logic signed [ IN_WIDTH-1:0] data_in,
    output logic signed [OUT_WIDTH-1:0] data_out
);
  localparam int RSHIFT = IN_FRAC > OUT_FRAC ? IN_FRAC - OUT_FRAC : 0;
  localparam int LSHIFT = OUT_FRAC > IN_FRAC ? OUT_FRAC - IN_FRAC : 0;
  // wide enough for the shifted value and a rounding carry, and for the saturation bounds
  localparam int EXT = (IN_WIDTH > RSHIFT + 1 ? IN_WIDTH : RSHIFT + 1) + 1;
  localparam int MID = (EXT + LSHIFT > OUT_WIDTH ? EXT + LSHIFT : OUT_WIDTH) + 1;

  logic signed [EXT-1:0] ext;
  logic signed [MID-1:0] shifted;
  assign ext = EXT'(data_in);  // sign-extended

  if (RSHIFT > 0) begin : g_round
    logic signed [EXT-1:0] floor_q;
    logic [RSHIFT-1:0] rem;
    logic up;
    assign floor_q = ext >>> RSHIFT;
    assign rem = ext[RSHIFT-1:0];
    // round half to even: up when the remainder is above half, or exactly half and the floor is odd
    if (RSHIFT == 1) begin : g_one
      assign up = rem[0] && floor_q[0];
    end else begin : g_many
      assign up = rem[RSHIFT-1] && ((|rem[RSHIFT-2:0]) || floor_q[0]);
    end
    assign shifted = MID'(floor_q) + MID'($signed({1'b0, up}));
  end else begin : g_left
    assign shifted = MID'(ext) <<< LSHIFT;
  end

  localparam logic signed [MID-1:0] QMAX = MID'((64'sd1 <<< (OUT_WIDTH - 1)) - 64'sd1);
  localparam logic signed [MID-1:0] QMIN = MID'(-(64'sd1 <<< (OUT_WIDTH - 1)));
  always_comb begin
    if (shifted > QMAX) data_out = QMAX[OUT_WIDTH-1:0];
    else if (shifted < QMIN) data_out = QMIN[OUT_WIDTH-1:0];
    else data_out = shifted[OUT_WIDTH-1:0];
  end
endmodule
