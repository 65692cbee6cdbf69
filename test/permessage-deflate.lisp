;;;; permessage-deflate (RFC 7692): negotiated by an acceptor that codes
;;;; replies, compressed messages from clients inflated within the
;;;; acceptor's largest message (a deflate bomb closes with 1009), no
;;;; compression context kept between messages on either side.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite permessage-deflate :in all :description "Websocket messages compressed with deflate.")
(in-suite permessage-deflate)

(test permessage-deflate.offers-accepted-and-declined
  (loop for (offers answer bits)
          in '(("permessage-deflate" "permessage-deflate; server_no_context_takeover; client_no_context_takeover" 15)
               ("permessage-deflate; client_max_window_bits"
                "permessage-deflate; server_no_context_takeover; client_no_context_takeover" 15)
               ("permessage-deflate; client_max_window_bits=10; server_no_context_takeover"
                "permessage-deflate; server_no_context_takeover; client_no_context_takeover" 15)
               ("permessage-deflate; server_max_window_bits=10"
                "permessage-deflate; server_no_context_takeover; client_no_context_takeover; server_max_window_bits=10" 10)
               ("permessage-deflate; server_max_window_bits=8, permessage-deflate"
                "permessage-deflate; server_no_context_takeover; client_no_context_takeover" 15)
               ("permessage-deflate; server_max_window_bits=8" nil nil)
               ("permessage-deflate; server_max_window_bits" nil nil)
               ("permessage-deflate; client_max_window_bits=16" nil nil)
               ("permessage-deflate; server_no_context_takeover=1" nil nil)
               ("permessage-deflate; server_no_context_takeover; server_no_context_takeover" nil nil)
               ("permessage-deflate; unknown" nil nil)
               ("x-webkit-deflate-frame" nil nil)
               ("" nil nil)
               (nil nil nil))
        do (multiple-value-bind (got got-bits) (hunchentoot-recycling-taskmaster::accept-permessage-deflate offers)
             (is (equal answer got) "~S: ~S" offers got)
             (is (eql bits got-bits) "~S: ~S bits" offers got-bits))))

(defun deflated (octets)
  "OCTETS as a permessage-deflate message carries them."
  (let ((stream (hunchentoot-recycling-taskmaster::make-raw-deflate-stream 6 15)))
    (unwind-protect (hunchentoot-recycling-taskmaster::raw-deflate-message
                     stream (coerce octets '(simple-array (unsigned-byte 8) (*))))
      (hunchentoot-recycling-taskmaster::free-gzip-stream stream))))

(defun inflated (octets)
  (let ((stream (hunchentoot-recycling-taskmaster::make-inflate-stream)))
    (unwind-protect (hunchentoot-recycling-taskmaster::inflate-octets
                     stream (coerce octets '(simple-array (unsigned-byte 8) (*))) 0 (length octets)
                     (* 64 1024 1024) (constantly t))
      (hunchentoot-recycling-taskmaster::free-inflate-stream stream))))

(defun read-message (socket)
  "The opcode and payload of the next message the server sent, in one
frame, inflated when its RSV1 says it is compressed; second value, whether
it was."
  (multiple-value-bind (opcode payload fin masked compressed-p) (read-frame socket)
    (declare (ignore fin masked))
    (values opcode (if compressed-p (inflated payload) payload) compressed-p)))

(defun deflate-server (&rest initargs)
  (apply #'make-server 'parallel-easy-acceptor :compression '(:gzip) initargs))

(defun lorem-octets (kb)
  (flex:string-to-octets (lorem-text kb) :external-format :utf-8))

(test permessage-deflate.compressed-messages-echoed-whole
  (with-thread-leak-check ()
    (with-server (server (deflate-server))
      (let ((text (lorem-text 100)))
        (with-websocket (socket server "/echo" :extensions "permessage-deflate; client_max_window_bits")
          ;; One frame of 100 KB compressed, echoed compressed.
          (send-frame socket 1 (deflated (lorem-octets 100)) :rsv 4)
          (multiple-value-bind (opcode payload compressed-p) (read-message socket)
            (is (eql 1 opcode))
            (is-true compressed-p "the server compresses what it sends")
            (is (equal text (flex:octets-to-string payload :external-format :utf-8))
                "a compressed text of 100 KB comes back whole"))
          ;; A compressed binary message in three frames: RSV1 on the first only.
          (let* ((payload (deflated (lorem-octets 20)))
                 (third (floor (length payload) 3)))
            (send-frame socket 2 (subseq payload 0 third) :rsv 4 :fin nil)
            (send-frame socket 0 (subseq payload third (* 2 third)) :fin nil)
            (send-frame socket 0 (subseq payload (* 2 third)) :fin t)
            (multiple-value-bind (opcode octets) (read-message socket)
              (is (eql 2 opcode))
              (is (equalp (lorem-octets 20) octets) "fragmented, it comes back whole")))
          ;; An empty compressed message, then one not compressed, on the
          ;; same websocket; too short to be compressed back.
          (send-frame socket 1 #() :rsv 4)
          (is (equal "" (read-text socket)) "an empty compressed message is the empty text")
          (send-frame socket 1 "plain")
          (multiple-value-bind (opcode payload compressed-p) (read-message socket)
            (is (eql 1 opcode))
            (is (equalp (text-octets "plain") payload))
            (is-false compressed-p "shorter than :compression-min-bytes: sent as it is")))))))

(test permessage-deflate.a-broadcast-compressed-once-for-every-client
  (with-thread-leak-check ()
    (with-server (server (deflate-server))
      (let ((sockets (loop repeat 3 collect (open-websocket server "/chat" :extensions "permessage-deflate")))
            (plain (open-websocket server "/chat")))
        (unwind-protect
             (let ((text (lorem-text 4)))
               (is (wait-until (lambda () (= 4 (length (ws:clients *chat*))))))
               (send-frame (first sockets) 1 (deflated (lorem-octets 4)) :rsv 4)
               (dolist (socket sockets)
                 (multiple-value-bind (opcode payload compressed-p) (read-message socket)
                   (is (eql 1 opcode))
                   (is-true compressed-p)
                   (is (equal text (flex:octets-to-string payload :external-format :utf-8)))))
               (multiple-value-bind (opcode payload compressed-p) (read-message plain)
                 (is (eql 1 opcode))
                 (is-false compressed-p "a client that did not agree gets it plain")
                 (is (equal text (flex:octets-to-string payload :external-format :utf-8)))))
          (mapc #'usocket:socket-close (cons plain sockets)))))))

(test permessage-deflate.negotiated-in-the-101-only-when-coding
  (with-thread-leak-check ()
    (with-server (server (deflate-server))
      (multiple-value-bind (socket head) (open-websocket server "/echo" :extensions "permessage-deflate")
        (is (head-has-p head "Sec-WebSocket-Extensions: permessage-deflate; server_no_context_takeover; client_no_context_takeover"))
        (usocket:socket-close socket))
      (multiple-value-bind (socket head) (open-websocket server "/echo" :extensions "permessage-deflate; foo")
        (is (not (head-has-p head "Sec-WebSocket-Extensions")) "an offer it cannot honour is declined")
        (usocket:socket-close socket)))
    (with-server (server (make-server 'parallel-easy-acceptor))
      (multiple-value-bind (socket head) (open-websocket server "/echo" :extensions "permessage-deflate")
        (is (not (head-has-p head "Sec-WebSocket-Extensions")) "an acceptor without :compression declines")
        ;; RSV1 without the extension is a protocol error, as before.
        (send-frame socket 1 (deflated (lorem-octets 1)) :rsv 4)
        (is-true (failed-with-p socket 1002))
        (usocket:socket-close socket)))))

(defun megabyte-bomb ()
  "About 1 MB of deflate that inflates to about a gigabyte of zeros: the
sync-flushed deflate of 8 MiB of zeros, its blocks repeated."
  (let* ((block (concatenate '(simple-array (unsigned-byte 8) (*))
                             (deflated (make-array (* 8 1024 1024) :element-type '(unsigned-byte 8) :initial-element 0))
                             #(0 0 255 255)))
         (count (floor 1000000 (length block))))
    (subseq (apply #'concatenate '(simple-array (unsigned-byte 8) (*)) (loop repeat count collect block))
            0 (- (* count (length block)) 4))))

(test permessage-deflate.bomb-closes-1009-others-go-on
  (with-thread-leak-check ()
    (with-server (server (deflate-server))
      (let ((bomb (deflated (make-array (* 8 1024 1024) :element-type '(unsigned-byte 8) :initial-element 0)))
            (megabyte (megabyte-bomb)))
        (is (< (length bomb) (* 16 1024)) "8 MiB of zeros deflate to ~D octets" (length bomb))
        (is (< 900000 (length megabyte) 1000001))
        (with-websocket (other server "/echo" :extensions "permessage-deflate")
          (with-websocket (socket server "/echo" :extensions "permessage-deflate")
            (send-frame socket 2 bomb :rsv 4)
            (is-true (failed-with-p socket 1009) "inflated past :max-websocket-message-bytes: 1009"))
          (with-websocket (socket server "/echo" :extensions "permessage-deflate")
            (send-frame socket 2 megabyte :rsv 4)
            (is-true (failed-with-p socket 1009) "a 1 MB bomb, a gigabyte inflated: 1009"))
          (send-frame other 1 "still here")
          (is (equal "still here" (read-text other))))
        (is (<= (stats server :memory-held-bytes) (* 64 1024))
            "what the bomb took was given back: ~D" (stats server :memory-held-bytes))))))

(test permessage-deflate.bad-compressed-frames-close-the-websocket
  (with-thread-leak-check ()
    (with-server (server (deflate-server))
      (with-websocket (socket server "/echo" :extensions "permessage-deflate")
        (send-frame socket 1 (make-array 20 :element-type '(unsigned-byte 8) :initial-element 255) :rsv 4)
        (is-true (failed-with-p socket 1007) "not deflate: 1007"))
      (with-websocket (socket server "/echo" :extensions "permessage-deflate")
        (send-frame socket 1 (deflated (flex:string-to-octets "ab" :external-format :latin-1)) :rsv 4 :fin nil)
        (send-frame socket 0 (deflated (lorem-octets 1)) :rsv 4)
        (is-true (failed-with-p socket 1002) "RSV1 on a continuation: 1002"))
      (with-websocket (socket server "/echo" :extensions "permessage-deflate")
        (send-frame socket 1 (deflated (make-array 3 :element-type '(unsigned-byte 8) :initial-contents '(#xC3 #x28 #x41))) :rsv 4)
        (is-true (failed-with-p socket 1007) "inflated text not UTF-8: 1007"))
      (with-websocket (socket server "/echo" :extensions "permessage-deflate")
        (send-frame socket 9 (deflated (lorem-octets 0)) :rsv 4)
        (is-true (failed-with-p socket 1002) "RSV1 on a control frame: 1002")))))
