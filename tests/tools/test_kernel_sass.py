"""tools/kernel_sass.py reads a kernel's main loop out of nvdisasm's listing."""

from __future__ import annotations

from tools.kernel_sass import _opcode, main_loop

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R8, R4, 0x780000, R9, 0xea, !PT ;
        /*0040*/                   FFMA R10, R8, R6, R10 ;
        /*0050*/              @P0  BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   FADD R10, R10, R11 ;
        /*0070*/              @!P1 BRA `(.L_x_2) ;
        /*0080*/                   EXIT ;
"""


def test_the_longest_backward_branch_is_the_loop() -> None:
    body = main_loop(LISTING)
    assert [_opcode(t) for t in body] == ["LDG", "LOP3", "FFMA", "BRA"]


def test_without_a_loop_the_whole_kernel_counts() -> None:
    straight = "\n".join(line for line in LISTING.splitlines() if "BRA" not in line)
    assert [_opcode(t) for t in main_loop(straight)] == ["MOV", "S2R", "LDG", "LOP3", "FFMA", "FADD", "EXIT"]
