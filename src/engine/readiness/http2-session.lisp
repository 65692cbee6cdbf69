;;;; What the engine keeps of an HTTP/2 connection's protocol state beside
;;;; libnghttp2's (nghttp2-session.lisp, the one file that calls it): its
;;;; streams, their replies as they wait for the library, the lock every
;;;; call on the session is made under, and what the client has cost.
;;;;
;;;; What a client may cost.  A header list is decoded by the library
;;;; whatever its length; past the acceptor's limit its fields are no more
;;;; kept (the stream is refused 431), and past +HTTP2-HEADER-LIST-SLACK+
;;;; times it, or with more frames that carry nothing than
;;;; +HTTP2-IDLE-FRAMES+ and +HTTP2-IDLE-FRAMES-PER-STREAM+ allow, the
;;;; connection ends with ENHANCE_YOUR_CALM.  A stream opened below one
;;;; opened before ends it with PROTOCOL_ERROR (RFC 9113 5.1.1), which the
;;;; library lets pass.
;;;;
;;;; Each function here is called with the session's LOCK held, but those
;;;; that say they take it.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-max-continuations+ 16
  "The most CONTINUATION frames one header block may take: a client that
sends more is sent GOAWAY and the connection ends (CVE-2024-28182).  A
header list within the limit fits in two frames of the default size.")

(defconstant +http2-header-list-slack+ 4
  "How many times the acceptor's MAX-HEADER-BYTES a stream's header list
may decode to before its connection ends: one a little over the limit is
refused 431, one far over it is an attack (an HPACK bomb: a large field in
the dynamic table, then references to it).")

(defconstant +http2-idle-frames+ 10000
  "The frames carrying nothing (an empty DATA frame, PRIORITY) a connection
may send before any stream, and +HTTP2-IDLE-FRAMES-PER-STREAM+ more for
each stream it opens; one more ends it with ENHANCE_YOUR_CALM.")

(defconstant +http2-idle-frames-per-stream+ 64)

(defconstant +http2-closed-ids-kept+ 64
  "The streams closed lately whose ids a connection keeps, so that a late
trailer HEADERS for one of them is not taken for a stream opened out of
order.")

(defstruct (http2-session (:constructor %make-http2-session))
  "libnghttp2's server session of one connection, and its streams."
  (pointer (cffi:null-pointer))
  (lock (bt:make-lock "http2-session") :read-only t)
  ;; Notified when the library has read some of a reply, or a stream
  ;; closed, while ROOM-WAITERS makers of a reply wait for room: each looks
  ;; again.  A notice with none waiting would be a system call for nothing.
  (room (bt:make-condition-variable :name "http2-reply-room") :read-only t)
  (room-waiters 0 :type fixnum)
  ;; Stream id -> HTTP2-STREAM, for the streams not closed yet.
  (streams (make-hash-table) :read-only t)
  ;; Streams whose request is whole and not yet handed out, newest first.
  (ready '())
  ;; Limits, from the acceptor.
  (max-header-bytes 0 :type fixnum :read-only t)
  (max-body-bytes nil :read-only t)
  (budget nil :read-only t)
  ;; The CONNECTION-COUNTERS its streams, resets and GOAWAYs are counted in.
  (counters nil :read-only t)
  ;; The octets of its streams' replies queued and not read by the library
  ;; yet, charged to BUDGET.
  (reply-octets 0 :type fixnum)
  ;; CONTINUATION frames of the header block being received; true once
  ;; the client sent what ends the connection with ENHANCE_YOUR_CALM.
  (continuations 0 :type fixnum)
  (flooded-p nil)
  ;; Streams the client opened, and the frames carrying nothing it sent.
  (opened-streams 0 :type fixnum)
  (idle-frames 0 :type fixnum)
  ;; The highest stream id a HEADERS frame has named, and the ids of the
  ;; last +HTTP2-CLOSED-IDS-KEPT+ streams closed, a ring, with where the
  ;; next goes: a HEADERS naming a lower id that is neither open nor closed
  ;; lately opens a stream out of order (RFC 9113 5.1.1), which the
  ;; library would ignore; trailers for a stream just reset are allowed.
  (highest-stream-id 0 :type fixnum)
  (closed-ids (make-array +http2-closed-ids-kept+ :element-type 'fixnum :initial-element 0) :read-only t)
  (closed-ids-next 0 :type fixnum)
  ;; True once the client broke the protocol in a way the library lets
  ;; pass: the session ends with PROTOCOL_ERROR.
  (protocol-error-p nil))

(defun note-http2-flood (session)
  "SESSION's client sent what ends the connection with ENHANCE_YOUR_CALM:
the callback that found it answers the library's failure code."
  (setf (http2-session-flooded-p session) t)
  +nghttp2-err-callback-failure+)

(defun tell-room-waiters (session)
  "Wake the makers of SESSION's replies that wait for room, if any."
  (when (plusp (http2-session-room-waiters session))
    (condition-broadcast (http2-session-room session))))

(defun drop-http2-reply (session stream)
  "Forget what waits of STREAM's reply, its octets given back to SESSION's
memory budget, and wake makers waiting for room."
  (let ((octets (shiftf (http2-stream-reply-queued stream) 0)))
    (setf (http2-stream-reply-pieces stream) '()
          (http2-stream-reply-pieces-tail stream) '())
    (when (plusp octets)
      (decf (http2-session-reply-octets session) octets)
      (release-memory (http2-session-budget session) octets))
    (tell-room-waiters session)))

(defun note-http2-stream-closed (session stream)
  "STREAM of SESSION has closed: what it held given back, its id kept
among those closed lately, its ON-CLOSE called."
  (drop-http2-reply session stream)
  (let ((on-close (shiftf (http2-stream-on-close stream) nil)))
    (when on-close
      (funcall on-close)))
  (let ((next (http2-session-closed-ids-next session)))
    (setf (aref (http2-session-closed-ids session) next) (http2-stream-id stream)
          (http2-session-closed-ids-next session) (mod (1+ next) +http2-closed-ids-kept+))))

(defun watch-http2-stream-close (session stream function)
  "Have FUNCTION called as STREAM of SESSION closes (its ON-CLOSE): true;
false, nothing kept, when it has closed already.  Takes the lock."
  (bt:with-lock-held ((http2-session-lock session))
    (unless (eq (http2-stream-state stream) :closed)
      (setf (http2-stream-on-close stream) function)
      t)))

(defun stream-opened-out-of-order-p (session stream-id)
  "True when a HEADERS frame naming STREAM-ID, a client's stream, opens one
below the highest already named that is neither open nor closed lately."
  (and (oddp stream-id)
       (< stream-id (http2-session-highest-stream-id session))
       (not (gethash stream-id (http2-session-streams session)))
       (not (find stream-id (http2-session-closed-ids session)))))

(defun read-http2-reply-octets (session stream buffer length)
  "Copy up to LENGTH octets of what waits of STREAM's reply to BUFFER, a
foreign pointer, each piece let go of (given back to SESSION's budget) as
it is read whole; the count copied."
  (let ((copied 0))
    (loop while (and (< copied length) (http2-stream-reply-pieces stream))
          do (let* ((piece (first (http2-stream-reply-pieces stream)))
                    (start (http2-stream-reply-position stream))
                    (count (min (- length copied) (- (length piece) start))))
               (cffi:with-pointer-to-vector-data (from piece)
                 (cffi:foreign-funcall "memcpy" :pointer (cffi:inc-pointer buffer copied)
                                                :pointer (cffi:inc-pointer from start) :size count :pointer))
               (incf copied count)
               (if (= (+ start count) (length piece))
                   (progn (pop (http2-stream-reply-pieces stream))
                          (setf (http2-stream-reply-position stream) 0))
                   (setf (http2-stream-reply-position stream) (+ start count)))))
    (when (plusp copied)
      (decf (http2-stream-reply-queued stream) copied)
      (decf (http2-session-reply-octets session) copied)
      (release-memory (http2-session-budget session) copied)
      (tell-room-waiters session))
    copied))

(defun http2-frame-allowed-p (session type stream-id length flags)
  "Whether a frame of TYPE on STREAM-ID, of LENGTH octets and FLAGS, that
SESSION's client begins to send may be read: false, the session marked to
end, for a CONTINUATION past +HTTP2-MAX-CONTINUATIONS+, a frame carrying
nothing past the connection's allowance (both ENHANCE_YOUR_CALM), or a
HEADERS opening a stream out of order (PROTOCOL_ERROR)."
  (cond ((= type +nghttp2-headers+)
         (setf (http2-session-continuations session) 0)
         (if (stream-opened-out-of-order-p session stream-id)
             (progn (setf (http2-session-protocol-error-p session) t) nil)
             (progn (setf (http2-session-highest-stream-id session)
                          (max stream-id (http2-session-highest-stream-id session)))
                    t)))
        ((= type +nghttp2-continuation+)
         (or (<= (incf (http2-session-continuations session)) +http2-max-continuations+)
             (progn (note-http2-flood session) nil)))
        ((or (= type +nghttp2-priority+)
             (and (= type +nghttp2-data+) (zerop length) (not (logtest flags +nghttp2-flag-end-stream+))))
         (or (<= (incf (http2-session-idle-frames session))
                 (+ +http2-idle-frames+ (* +http2-idle-frames-per-stream+ (http2-session-opened-streams session))))
             (progn (note-http2-flood session) nil)))
        (t t)))

(defun take-http2-stream-body (session stream)
  "Take STREAM's request body from it, whole, with SESSION's lock: its
pieces, newest first, and their octets, charged to SESSION's memory
budget, which the taker gives back.  A request without one takes no lock:
a body comes before the request is whole, never after."
  (if (null (http2-stream-body-pieces stream))
      (values '() 0)
      (bt:with-lock-held ((http2-session-lock session))
        (values (shiftf (http2-stream-body-pieces stream) '())
                (shiftf (http2-stream-body-length stream) 0)))))

(defun http2-session-held-octets (session)
  "The octets SESSION holds for its client, asked with its lock: bodies
arriving, replies not taken by the library."
  (bt:with-lock-held ((http2-session-lock session))
    (+ (http2-session-reply-octets session)
       (loop for stream being the hash-values of (http2-session-streams session)
             sum (http2-stream-body-length stream)))))

(defun wait-for-http2-reply-room (session stream octets deadline)
  "Wait, with SESSION's lock, until at most OCTETS of STREAM's reply wait
for the library, or STREAM has ended, or the internal real time DEADLINE:
:ROOM, :CLOSED or :TIMEOUT."
  (bt:with-lock-held ((http2-session-lock session))
    (incf (http2-session-room-waiters session))
    (unwind-protect
         (loop (cond ((or (eq (http2-stream-state stream) :closed) (cffi:null-pointer-p (http2-session-pointer session)))
                      (return :closed))
                     ((<= (http2-stream-reply-queued stream) octets) (return :room))
                     ((>= (get-internal-real-time) deadline) (return :timeout)))
               (bt:condition-wait (http2-session-room session) (http2-session-lock session)
                                  :timeout (seconds-until deadline)))
      (decf (http2-session-room-waiters session)))))
