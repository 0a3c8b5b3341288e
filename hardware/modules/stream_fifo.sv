// stream_fifo: DEPTH beats of buffering on a valid/ready stream (registered ready and valid).
`timescale 1ns / 1ps
module stream_fifo #(
    parameter int DATA_IN_0_PRECISION_0 = 8,
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = 1,
    parameter int DEPTH = 4
) (
    input  logic clk,
    input  logic rst,
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_IN_0_PRECISION_0-1:0] data_out_0 [DATA_IN_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
  localparam int AB = DEPTH > 1 ? $clog2(DEPTH) : 1;
  localparam int CB = $clog2(DEPTH + 1);
  localparam int P = DATA_IN_0_PARALLELISM_DIM_0;
  logic signed [DATA_IN_0_PRECISION_0-1:0] mem[DEPTH*P];  // beat k at [k*P +: P]
  logic [AB-1:0] head, tail;
  logic [CB-1:0] count;
  logic push, pop;
  assign data_in_0_ready = int'(count) < DEPTH;
  assign data_out_0_valid = count != '0;
  for (genvar i = 0; i < P; i++) begin : g_out
    assign data_out_0[i] = mem[int'(head)*P+i];
  end
  assign push = data_in_0_valid && data_in_0_ready;
  assign pop = data_out_0_valid && data_out_0_ready;
  always_ff @(posedge clk) begin
    if (rst) begin
      head  <= '0;
      tail  <= '0;
      count <= '0;
    end else begin
      if (push) begin
        for (int i = 0; i < P; i++) mem[int'(tail)*P+i] <= data_in_0[i];
        tail <= int'(tail) == DEPTH - 1 ? '0 : tail + 1'b1;
      end
      if (pop) head <= int'(head) == DEPTH - 1 ? '0 : head + 1'b1;
      if (push && !pop) count <= count + 1'b1;
      else if (pop && !push) count <= count - 1'b1;
    end
  end
endmodule
