;;;; A websocket message that arrives over several reads or frames: its
;;;; octets kept in pieces of at most +MESSAGE-PIECE-BYTES+, each no larger
;;;; than what its frame still announces (but 4 KiB at least) and taken
;;;; from the memory budget before it is made, so that a message costs what
;;;; has arrived of it (never twice its size, as a vector grown by doubling
;;;; would), and a budget with no room refuses the piece instead of the
;;;; heap.  Joined into one vector when the message is whole.  Only the
;;;; connection's holder touches its message.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +message-piece-bytes+ 131072
  "The largest piece a message's octets are kept in: 128 KiB, SBCL's
large objects, which its collector promotes without copying.  Pieces of
64 KiB, copied at each collection they survive, exhausted a 256 MB heap
with a 64 MB budget full of them (bench/profiles/2026-11-27-memory-budget.txt).")

(defstruct (arriving-message (:constructor make-arriving-message ()))
  "The octets of a websocket message so far."
  ;; Vectors of octets, newest first; all full but the newest.
  (pieces '())
  ;; The octets in the newest piece.
  (fill 0 :type fixnum)
  ;; The octets in every piece together.
  (length 0 :type fixnum)
  ;; The octets of the pieces, taken from the memory budget.
  (reserved 0 :type fixnum))

(defun add-message-octets (message budget buffer start end frame-rest room)
  "Keep the octets of BUFFER from START below END with MESSAGE, FRAME-REST
being the octets of their frame from START on, and ROOM what the message
may still take; a new piece is taken from BUDGET first.  True; NIL when
BUDGET had no room for a piece (the octets are then not all kept)."
  (loop while (< start end)
        do (let ((piece (first (arriving-message-pieces message))))
             (when (or (null piece) (= (arriving-message-fill message) (length piece)))
               ;; At least 4 KiB, so that a message of tiny frames is not
               ;; kept in tiny vectors.
               (let ((size (min +message-piece-bytes+ (max frame-rest 4096) room)))
                 (unless (reserve-memory budget size :input-p t)
                   (return-from add-message-octets nil))
                 (incf (arriving-message-reserved message) size)
                 (setf piece (make-array size :element-type '(unsigned-byte 8))
                       (arriving-message-fill message) 0)
                 (push piece (arriving-message-pieces message))))
             (let* ((fill (arriving-message-fill message))
                    (count (min (- end start) (- (length piece) fill))))
               (replace piece buffer :start1 fill :start2 start :end2 (+ start count))
               (incf (arriving-message-fill message) count)
               (incf (arriving-message-length message) count)
               (incf start count)
               (decf frame-rest count)
               (decf room count))))
  t)

(defun message-octets (message)
  "The octets of MESSAGE in one vector (its only piece when that holds
them exactly)."
  (let ((pieces (reverse (arriving-message-pieces message)))
        (length (arriving-message-length message)))
    (if (and (= 1 (length pieces)) (= length (length (first pieces))))
        (first pieces)
        (let ((octets (make-array length :element-type '(unsigned-byte 8)))
              (position 0))
          (dolist (piece pieces octets)
            (let ((count (min (length piece) (- length position))))
              (replace octets piece :start1 position :end2 count)
              (incf position count)))))))

(defun release-message (message budget)
  "Give the pieces of MESSAGE back to BUDGET."
  (release-memory budget (shiftf (arriving-message-reserved message) 0)))
