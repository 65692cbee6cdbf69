;;;; Random octets from the kernel (getrandom(2)), for what must not be
;;;; guessed: session ids and secrets.

(in-package #:hunchentoot-recycling-taskmaster)

(defun kernel-random-octets (count)
  "COUNT octets from the kernel's random source, in a fresh octet vector."
  (let ((octets (make-array count :element-type '(unsigned-byte 8))))
    (sb-sys:with-pinned-objects (octets)
      (loop with filled = 0
            while (< filled count)
            do (let ((result (without-blocking
                              (sb-alien:alien-funcall
                               (sb-alien:extern-alien "getrandom"
                                                      (function sb-alien:long sb-sys:system-area-pointer
                                                                sb-alien:unsigned-long sb-alien:unsigned-int))
                               (sb-sys:sap+ (sb-sys:vector-sap octets) filled) (- count filled) 0))))
                 ;; The kernel's source never blocks once seeded at boot.
                 (if (integerp result)
                     (incf filled result)
                     (foreign-error "getrandom")))))
    octets))

(defun kernel-random-integer (bits)
  "A non-negative integer of BITS random bits (a multiple of 8) from the kernel."
  (loop for octet across (kernel-random-octets (floor bits 8))
        for integer = octet then (logior (ash integer 8) octet)
        finally (return integer)))
