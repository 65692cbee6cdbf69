;;;; Every use of SBCL's compiler internals lives in this file: a VOP of our
;;;; own for x86-64's PREFETCHT0, which SBCL 2.2.9's assembler knows and
;;;; offers no function for, and a structure's size.
;;;;
;;;; Why: at 1,000 kept-alive connections each request's connection was
;;;; last touched a thousand requests before, out of every cache, and a
;;;; turn reads its objects one after another, each a wait on memory.
;;;; Asked for while the connection waits its turn, they are there when it
;;;; comes (bench/profiles/2026-12-02-prefetched-connections.txt).

(in-package #:hunchentoot-recycling-taskmaster)

#+x86-64
(eval-when (:compile-toplevel :load-toplevel :execute)
  (sb-c:defknown %prefetch-octet (t sb-vm:word) (values) (sb-c:always-translatable)
    :overwrite-fndb-silently t)
  (sb-vm::define-vop (%prefetch-octet)
    (:translate %prefetch-octet)
    (:policy :fast-safe)
    (:args (object :scs (sb-vm::descriptor-reg sb-vm::any-reg))
           (offset :scs (sb-vm::unsigned-reg)))
    (:arg-types * sb-vm::unsigned-num)
    (:generator 1 (sb-assem:inst prefetch :t0 (sb-vm::ea 0 object offset 1)))))

#+x86-64
(defun %prefetch-octet (object offset)
  (%prefetch-octet object offset))

(declaim (inline prefetch-octets))
(defun prefetch-octets (object octets)
  "Ask the processor to bring into its caches the OCTETS octets from
OBJECT's address on, and go on without waiting: a hint, never a fault,
whatever OBJECT is."
  (declare (type (integer 1 4096) octets))
  #+x86-64 (progn
             (loop for offset of-type sb-vm:word from 0 below octets by 64
                   do (%prefetch-octet object offset))
             (%prefetch-octet object (1- octets)))
  #-x86-64 (declare (ignore object octets))
  (values))

(defun structure-octets (instance)
  "The octets the structure INSTANCE takes, its header included."
  (* sb-vm:n-word-bytes (1+ (sb-kernel:%instance-length instance))))
