// stream_join: the valid/ready handshake of a combinational stage reading N streams (N = 1: it passes through).
// The output beat is valid when every input's is; an input is taken (ready) when the output is and every other
// input is valid, so all inputs are taken in the same cycle. Used by fixed_relu, fixed_requant and fixed_add.
`timescale 1ns / 1ps
module stream_join #(
    parameter int N = 1
) (
    input  logic [N-1:0] in_valid,
    output logic [N-1:0] in_ready,
    output logic out_valid,
    input  logic out_ready
);
  assign out_valid = &in_valid;
  for (genvar k = 0; k < N; k++) begin : g_in
    assign in_ready[k] = out_ready && &(in_valid | (N'(1) << k));
  end
endmodule
