;;;; Replies the socket does not take at once.  A reply the engine has whole
;;;; -- its head, the octets a handler returned, ranges of a file -- is a
;;;; list of pieces, sent without waiting on the non-blocking socket.  What
;;;; the socket buffer does not take stays with the connection as its
;;;; OUTGOING, and the connection is parked until the socket has room; then
;;;; whichever worker (or, while none is free, the thread-making thread)
;;;; takes it sends more.  A client that reads slowly so holds a descriptor
;;;; and its reply's pieces, never a thread.  Only the holder of a
;;;; connection touches its OUTGOING (connection.lisp, Ownership).

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (piece (:constructor make-octets-piece (octets start end))
                  (:constructor make-file-piece (start end &aux (octets nil)))
                  (:constructor make-counted-piece
                      (counted &aux (octets (counted-octets-octets counted)) (start 0) (end (length octets)))))
  "Part of a reply: the octets of OCTETS from START below END, or, when
OCTETS is NIL, those of the reply's file.  START moves as they are sent."
  (octets nil :type (or null octets))
  (start 0 :type fixnum)
  (end 0 :type fixnum)
  ;; The COUNTED-OCTETS whose OCTETS these are, held by this piece until it
  ;; is sent or dropped; NIL for octets counted otherwise.
  (counted nil))

(defstruct (outgoing (:constructor make-outgoing (pieces file-fd)))
  "What a connection's reply has left to send."
  ;; The pieces not sent whole yet, in order.
  (pieces '() :type list)
  ;; The descriptor file pieces are read from, this OUTGOING's own (a
  ;; duplicate of the handler's), closed with it; NIL when there is none.
  (file-fd nil)
  ;; What follows once every piece has gone: :KEEP-ALIVE (the connection's
  ;; next request) or :CLOSE.
  (then :close)
  ;; The octets of its pieces copied from a buffer the caller reuses,
  ;; charged to the memory budget until it is dropped.
  (charged 0 :type fixnum))

(defun send-pieces (fd pieces file-fd)
  "Send PIECES in order to the socket FD without waiting, file pieces from
FILE-FD.  Returns :SENT; :FAILED when the client has gone or the file ended
early; or the pieces left, the first one's START moved past what went."
  (loop for tail on pieces
        for piece = (first tail)
        do (loop while (< (piece-start piece) (piece-end piece))
                 do (let ((count (if (piece-octets piece)
                                     (send-octets fd (piece-octets piece) (piece-start piece) (piece-end piece)
                                                  :more (rest tail))
                                     (send-file-octets fd file-fd (piece-start piece) (piece-end piece)))))
                      (case count
                        (:would-block (return-from send-pieces tail))
                        ((:error 0) (return-from send-pieces :failed))
                        (t (incf (piece-start piece) count)))))
        finally (return :sent)))

(defun keep-outgoing (set connection pieces file-fd borrowed-octets &optional owned-octets)
  "Make PIECES CONNECTION's OUTGOING: pieces of BORROWED-OCTETS (a buffer
the caller reuses) copied and their copies counted in SET's memory budget,
as are OWNED-OCTETS, the engine's own copy of the body (the octets of a
handler's string, a coded copy), when given; FILE-FD duplicated if a file
piece is left.  Octets the handler made are kept as they are and not
counted: they are the application's, and may be one vector every reply
shares.  False when no descriptor was left to duplicate it with."
  (let ((file-fd (and (notevery #'piece-octets pieces) (duplicate-fd file-fd))))
    (when (or file-fd (every #'piece-octets pieces))
      (let* ((copied 0)
             (outgoing (make-outgoing (loop for piece in pieces
                                            collect (if (and borrowed-octets (eq (piece-octets piece) borrowed-octets))
                                                        (let ((count (- (piece-end piece) (piece-start piece))))
                                                          (incf copied count)
                                                          (make-octets-piece (subseq borrowed-octets (piece-start piece)
                                                                                     (piece-end piece))
                                                                             0 count))
                                                        piece))
                                      file-fd)))
        (when owned-octets
          (incf copied (length owned-octets)))
        (setf (outgoing-charged outgoing) copied
              (connection-outgoing connection) outgoing)
        ;; The copies are made: counted, not refused.
        (charge-memory (readiness-set-memory-budget set) copied))
      (atomic-increment (readiness-set-outgoing-count set))
      t)))

(defun send-reply-pieces-without-waiting (set connection pieces file-fd borrowed-octets)
  "Send the reply PIECES (file pieces from FILE-FD, which stays the
caller's) on CONNECTION, held by the caller, as far as its socket takes
them now; keep the rest as its OUTGOING, copying what lies in
BORROWED-OCTETS.  True when they went or will; false when the client has
gone or the file ended early."
  (let ((left (send-pieces (connection-fd connection) pieces file-fd)))
    (case left
      (:sent t)
      (:failed nil)
      (t (keep-outgoing set connection left file-fd borrowed-octets)))))

(defun body-pieces (body)
  "BODY -- NIL, octets, or a list of pieces -- as a list of pieces."
  (if (listp body) body (list (make-octets-piece body 0 (length body)))))

(defconstant +copy-buffer-octets+ 65536
  "The piece in which a file is copied where it cannot be sent by sendfile.")

(defun copy-file-octets (file-fd stream start end)
  "Write the octets of FILE-FD from START below END to STREAM through a
buffer.  True when they all could be read; false when the file ended early
(it was truncated)."
  (let ((buffer (make-array (min +copy-buffer-octets+ (max 1 (- end start))) :element-type '(unsigned-byte 8))))
    (loop for position = start then (+ position count)
          for count = (and (< position end) (read-file-octets file-fd buffer position))
          while (and count (plusp count))
          do (write-sequence buffer stream :end (min count (- end position)))
          finally (return (>= position end)))))

(defgeneric write-reply-body (body file-fd stream)
  (:documentation "Write BODY -- NIL, octets the writer keeps no more, or a
list of pieces whose file pieces are copied from FILE-FD -- to STREAM, the
whole body of a reply.  True when it all went whole."))

(defmethod write-reply-body (body file-fd stream)
  (loop for piece in (body-pieces body)
        always (if (piece-octets piece)
                   (progn (write-sequence (piece-octets piece) stream
                                          :start (piece-start piece) :end (piece-end piece))
                          t)
                   (copy-file-octets file-fd stream (piece-start piece) (piece-end piece)))))

(defun send-reply-without-waiting (set connection head head-end body file-fd &optional owned-body-p)
  "Send a reply on CONNECTION, held by the caller, as far as its socket
takes it now: the octets of HEAD below HEAD-END (a buffer the caller
reuses), then BODY -- NIL, octets, or a list of pieces whose file pieces
are read from FILE-FD, which stays the caller's.  The rest is kept as
CONNECTION's OUTGOING, counted in the memory budget when OWNED-BODY-P says
BODY is octets the engine made (KEEP-OUTGOING); nothing is allocated when
the socket takes the head and a body of octets whole.  True when the reply
went or will; false when the client has gone or the file ended early."
  (let ((sent (send-octets (connection-fd connection) head 0 head-end :more body))
        (owned (and owned-body-p (typep body 'octets) body)))
    (cond ((eq sent :error) nil)
          ((and (eql sent head-end) (typep body 'octets))
           (let ((body-sent (send-octets (connection-fd connection) body 0 (length body))))
             (cond ((eq body-sent :error) nil)
                   ((eql body-sent (length body)) t)
                   (t (keep-outgoing set connection
                                     (list (make-octets-piece body (if (integerp body-sent) body-sent 0)
                                                              (length body)))
                                     nil nil owned)))))
          ((eql sent head-end)
           (or (null body) (send-reply-pieces-without-waiting set connection body file-fd nil)))
          (t (keep-outgoing set connection
                            (cons (make-octets-piece head (if (integerp sent) sent 0) head-end) (body-pieces body))
                            file-fd head owned)))))

(defun drop-outgoing (set connection)
  "Forget CONNECTION's OUTGOING, sent or not, closing its file."
  (let ((outgoing (shiftf (connection-outgoing connection) nil)))
    (when (outgoing-file-fd outgoing)
      (close-fd (outgoing-file-fd outgoing)))
    (release-memory (readiness-set-memory-budget set) (outgoing-charged outgoing))
    (atomic-decrement (readiness-set-outgoing-count set))))

(defun send-outgoing (set connection)
  "Send more of CONNECTION's OUTGOING, held by the caller.  Returns what
follows when it has all gone (:KEEP-ALIVE or :CLOSE; the OUTGOING is
dropped), :WOULD-BLOCK when the socket is full again, or :CLOSE when the
client has gone or the file ended early."
  (let* ((outgoing (connection-outgoing connection))
         (left (send-pieces (connection-fd connection) (outgoing-pieces outgoing) (outgoing-file-fd outgoing))))
    (case left
      (:sent (drop-outgoing set connection)
       (setf (connection-awaiting connection) :input)
       (outgoing-then outgoing))
      (:failed :close)
      (t (setf (outgoing-pieces outgoing) left)
         :would-block))))
